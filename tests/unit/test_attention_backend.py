"""The attention backend choice per platform, from explicit facts (no GPU needed),
and the dispatch it drives."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import attention
from tandem.kernels.attention_backend import (
    AttentionBackend,
    AttentionFacts,
    choose_attention_backend,
    detect_attention_facts,
)

ALL = AttentionFacts(triton=True, sdpa_flash=True)
NONE = AttentionFacts(triton=False, sdpa_flash=False)
B = AttentionBackend


@pytest.mark.parametrize(
    "device,dtype,head_dim,facts,backend,flash",
    [
        ("cpu", torch.bfloat16, 64, ALL, B.CPU_NATIVE, False),
        ("cpu", torch.float32, 128, NONE, B.CPU_NATIVE, False),
        ("cuda", torch.bfloat16, 64, ALL, B.TRITON_PAGED, True),
        ("cuda", torch.float16, 128, ALL, B.TRITON_PAGED, True),
        # FlashAttention takes half types only; float32 prefills use another SDPA kernel
        ("cuda", torch.float32, 64, ALL, B.TRITON_PAGED, False),
        ("cuda", torch.bfloat16, 256, ALL, B.TRITON_PAGED, True),
        # beyond the Triton kernel's and FlashAttention's head sizes
        ("cuda", torch.bfloat16, 512, ALL, B.TORCH_SDPA, False),
        # FlashAttention needs head sizes in multiples of 8
        ("cuda", torch.bfloat16, 60, ALL, B.TRITON_PAGED, False),
        ("cuda", torch.bfloat16, 64, AttentionFacts(triton=False, sdpa_flash=True),
         B.TORCH_SDPA, True),
        ("cuda", torch.bfloat16, 64, AttentionFacts(triton=True, sdpa_flash=False),
         B.TRITON_PAGED, False),
        ("mps", torch.float16, 64, ALL, B.TORCH_SDPA, False),
    ],
)
def test_choice(device, dtype, head_dim, facts, backend, flash):
    choice = choose_attention_backend(device, dtype, head_dim, facts)
    assert (choice.backend, choice.prefill_flash) == (backend, flash)
    assert choice.reason


@pytest.mark.parametrize("head_dim", [0, -2, 63])
def test_choice_rejects_bad_head_dim(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        choose_attention_backend("cuda", torch.bfloat16, head_dim, ALL)


def test_detected_facts_are_consistent_with_this_build():
    facts = detect_attention_facts()
    if torch.version.cuda is None:
        assert not facts.sdpa_flash


def test_metadata_backend_overrides_the_per_tensor_dispatch(monkeypatch):
    """A runner's choice (``meta.attention_backend``) is what runs, not the tensors'
    kernel backend: TORCH_SDPA on CPU tensors takes the reference path."""
    calls: list[str] = []
    for name in ("paged_attention_ref", "paged_attention_cpu"):
        def impl(*args, _name=name, **kwargs):
            calls.append(_name)
            return torch.zeros_like(args[0])
        monkeypatch.setitem(
            attention._IMPLEMENTATIONS,
            B.TORCH_SDPA if name.endswith("ref") else B.CPU_NATIVE, impl,
        )
    monkeypatch.setattr(attention, "paged_attention_cpu",
                        attention._IMPLEMENTATIONS[B.CPU_NATIVE])
    meta = attention.build_attention_metadata([1], [0], [[0]], 4)
    kv = torch.zeros(1, 4, 1, 8)
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    attention.paged_attention(q, k, k, (kv, kv), meta, 1.0)
    meta.attention_backend = B.TORCH_SDPA
    attention.paged_attention(q, k, k, (kv, kv), meta, 1.0)
    assert calls == ["paged_attention_cpu", "paged_attention_ref"]
