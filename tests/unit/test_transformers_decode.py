"""``transformers_decode``: a bf16 decode step of a Llama-form transformers model through
the one-call kernel equals the same step through transformers' code (bf16 tolerance:
another rounding order), and writes the same K/V into the cache."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config, tiny_hf_model

from tandem.engine.models.registry import build_model
from tandem.engine.models.transformers_decode import TransformersFusedDecode
from tandem.kernels.attention import build_attention_metadata
from tandem.kernels.fused_decode import FusedDecode
from tandem.kernels.linear import pack_linear_layers

pytestmark = pytest.mark.skipif(not FusedDecode.available(),
                                reason="the fused decode kernel needs AVX512-BF16")

BLOCK = 16
#: a Llama; Qwen2 (q/k/v biases); Mistral (a sliding window shorter than the context)
ARCHS = {"LlamaForCausalLM": {}, "Qwen2ForCausalLM": {},
         "MistralForCausalLM": {"sliding_window": 8}}


def _model(arch: str):
    config = tiny_config(arch, vocab=256, hidden=64, ffn=128, heads=4, kv_heads=2,
                         max_len=128, special_tokens=False, **ARCHS[arch])
    hf = tiny_hf_model(config, std=0.1, seed=5)
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = build_model(config, state.items(), torch.bfloat16, "cpu", 128,
                        model_impl="transformers")
    pack_linear_layers(model)
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_decode_step_equals_transformers_code(arch: str) -> None:
    model = _model(arch)
    assert isinstance(model.fused_decode, TransformersFusedDecode)
    lens = [5, 19]  # context before the decode token
    tables = [[0, 1], [2, 3]]
    g = torch.Generator().manual_seed(0)
    shape = (4, BLOCK, len(model.shard.kv_heads), model.shard.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in range(model.config.num_hidden_layers)]
    with torch.inference_mode():
        ids = torch.randint(0, 256, (sum(lens),), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])
        meta = build_attention_metadata(lens, [0, 0], tables, BLOCK)
        model(ids, pos, caches, meta)  # prefill: transformers' code
        step_ids = torch.randint(0, 256, (2,), generator=g)
        step_pos = torch.tensor(lens)
        step = build_attention_metadata([1, 1], lens, tables, BLOCK)
        assert FusedDecode.serves(step)
        theirs_caches = [(k.clone(), v.clone()) for k, v in caches]
        fused, model.fused_decode = model.fused_decode, None
        theirs = model(step_ids, step_pos, theirs_caches, step)
        model.fused_decode = fused
        ours = fused(step_ids, step_pos, caches, step)
    assert ours is not None, "the kernel serves a decode-only bf16 step"
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=3e-2, atol=3e-2)
    for (k, v), (tk, tv) in zip(caches, theirs_caches, strict=True):
        torch.testing.assert_close(k.float(), tk.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v.float(), tv.float(), rtol=2e-2, atol=2e-2)
        assert k.abs().sum() > 0


def test_other_model_types_and_float32_run_transformers_code() -> None:
    config = tiny_config("GraniteForCausalLM", vocab=256, hidden=64, ffn=128,
                         special_tokens=False)
    hf = tiny_hf_model(config, std=0.1, seed=5)
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    model = build_model(config, state.items(), torch.bfloat16, "cpu", 128,
                        model_impl="transformers")
    assert model.fused_decode is None  # residual multipliers: not the kernel's layer
    llama = tiny_config("LlamaForCausalLM", vocab=256, hidden=64, ffn=128,
                        special_tokens=False)
    hf = tiny_hf_model(llama, std=0.1, seed=5)
    model = build_model(llama, hf.state_dict().items(), torch.float32, "cpu", 128,
                        model_impl="transformers")
    assert model.fused_decode is None
