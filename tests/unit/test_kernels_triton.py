"""Triton kernels against the torch references, on the CPU via Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported (its own
library functions are decorated at import). When another test module of this
pytest process imported it first (transformers may), this module re-runs itself
in a fresh interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - explicit opt-out
    pytest.skip("TRITON_INTERPRET is not 1", allow_module_level=True)

in_process = pytest.mark.skipif(
    _TRITON_PREIMPORTED, reason="triton imported without the interpreter: see the rerun"
)


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="running in this process")
def test_rerun_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


from tandem.kernels.attention import (  # noqa: E402
    build_attention_metadata,
    paged_attention_ref,
    paged_attention_triton,
)
from tandem.kernels.cache import (  # noqa: E402
    allocate_kv_cache,
    reshape_and_cache_ref,
    reshape_and_cache_triton,
)
from tandem.kernels.layernorm import rms_norm_ref, rms_norm_triton  # noqa: E402


# NOTE: float16, not bfloat16: the interpreter computes through numpy, which has no
# bfloat16 (bf16 kernels give NaN there); the bf16 path is exercised on a GPU.
@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_triton_matches_ref(dtype, hidden):
    torch.manual_seed(0)
    x = (torch.randn(5, hidden) * 3).to(dtype)
    w = torch.randn(hidden).to(dtype)
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=atol, rtol=0
    )


@in_process
def test_reshape_and_cache_triton_matches_ref():
    torch.manual_seed(0)
    bs, kvh, hd = 4, 2, 8
    ref = allocate_kv_cache(6, 3, bs, kvh, hd, torch.float32)
    tri = ref.clone()
    slots = torch.tensor([5 * bs + 3, 0, 2 * bs + 1, 7])
    # value as a strided view of a fused projection, as the model passes it
    fused = torch.randn(4, 3 * kvh * hd)
    key = fused[:, : kvh * hd].view(4, kvh, hd)
    value = fused[:, 2 * kvh * hd :].view(4, kvh, hd)
    reshape_and_cache_ref(key, value, ref[:, 1, 0], ref[:, 1, 1], slots // bs, slots % bs)
    reshape_and_cache_triton(key, value, tri[:, 1, 0], tri[:, 1, 1], slots)
    torch.testing.assert_close(tri, ref, rtol=0, atol=0)


@in_process
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_triton_matches_ref(num_heads, num_kv_heads, window):
    torch.manual_seed(1)
    bs, hd, num_blocks = 4, 16, 48
    # decodes (incl. a 1-token prompt), a fresh prompt and a prefix-cached chunk
    seqs = [(9, 1), (16, 1), (0, 1), (22, 1), (0, 7), (5, 6)]
    kv = allocate_kv_cache(num_blocks, 1, bs, num_kv_heads, hd, torch.float32)
    kv.normal_()  # stale data in unused slots must not leak into results
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    query = torch.randn(meta.num_tokens, num_heads, hd)
    key = torch.randn(meta.num_tokens, num_kv_heads, hd)
    value = torch.randn(meta.num_tokens, num_kv_heads, hd)
    reshape_and_cache_ref(key, value, *layer, meta.block_idx, meta.block_offset)
    ref = paged_attention_ref(query, key, value, *layer, meta, hd**-0.5, window)
    tri = paged_attention_triton(query, key, value, *layer, meta, hd**-0.5, window)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "MistralForCausalLM"])
def test_model_on_triton_path_matches_transformers(arch, monkeypatch):
    """The wrappers' Triton branches wired end to end (what CUDA tensors take):
    q/k norm on strided views, K/V writes from the fused projection, decode
    attention from the blocks, sliding window; logits equal transformers'."""
    from tiny_models import tiny_config, tiny_hf_model

    from tandem.engine.models.registry import build_model
    from tandem.kernels import backend

    class TritonEverywhere(backend.KernelBackends):
        def for_tensor(self, t: torch.Tensor) -> backend.KernelBackend:
            return backend.KernelBackend.TRITON

    base = backend.current()
    monkeypatch.setattr(backend, "_current", TritonEverywhere(base.config, base.platform))
    window = 5 if arch.startswith("Mistral") else None
    config = tiny_config(arch, vocab=64, hidden=32, ffn=48, head_dim=16, max_len=64,
                         sliding_window=window)
    hf = tiny_hf_model(config, std=0.2, norms=(0.5, 1.5))
    model = build_model(config, hf.state_dict(), torch.float32, "cpu", 64)
    token_ids = list(range(3, 15))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    kv = allocate_kv_cache(8, 2, 4, 2, 16, torch.float32)
    views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(2)]
    logits, done = [], 0
    with torch.inference_mode():
        for n in (7, 1, 1, 3):  # a prompt chunk, two decodes, a prefix-cached chunk
            meta = build_attention_metadata([n], [done], [[7, 2, 5, 0]], 4)
            ids = torch.tensor(token_ids[done : done + n])
            logits.append(model.compute_logits(model(ids, meta.positions, views, meta)))
            done += n
    torch.testing.assert_close(torch.cat(logits), ref, rtol=0, atol=1e-4)
