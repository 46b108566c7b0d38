"""tandem's native Gemma 2, Gemma 3 (text) and Phi-3 against transformers on tiny
random-weight configs: float32 logits of every token, whole-prompt and chunked through
the paged cache, to ~1e-4; the Gemma norm in bf16 bit for bit; LongRoPE's tables and
partial rotary; weight-loading and config errors; the registry's choice.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from test_models import run_ours
from tiny_models import tiny_hf_model

from tandem.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaRMSNorm
from tandem.engine.models.phi3 import Phi3ForCausalLM, phi3_rope
from tandem.engine.models.registry import build_model, get_model_class, resolve_model_impl
from tandem.kernels.rotary import (
    RotaryEmbedding,
    compute_inv_freq,
    rope_attention_factor,
    rotary_embedding,
)

BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [1.0 + 0.9 * i for i in range(8)]}
GEMMA = {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24}


def gemma2_config(**extra: Any) -> transformers.Gemma2Config:
    """Alternating sliding (window 8) and global layers; softcaps small enough to bend."""
    return transformers.Gemma2Config(**BASE, **GEMMA, architectures=["Gemma2ForCausalLM"],
                                     attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                     **extra)


def gemma3_config(**extra: Any) -> transformers.Gemma3TextConfig:
    """Sliding and global layers alternating, each with its own rotary base; a linearly
    scaled global RoPE."""
    return transformers.Gemma3TextConfig(
        **BASE, **GEMMA, architectures=["Gemma3ForCausalLM"],
        layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=5.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}}, **extra)


def phi3_config(**extra: Any) -> transformers.Phi3Config:
    return transformers.Phi3Config(**BASE, architectures=["Phi3ForCausalLM"], **extra)


#: name -> (config, the engine's context (rotary tables), prompt length)
CASES: dict[str, tuple[Any, int, int]] = {
    "gemma2": (gemma2_config(), 128, 30),
    "gemma2-tied-off": (gemma2_config(tie_word_embeddings=False), 128, 30),
    "gemma3": (gemma3_config(), 128, 30),
    "phi3": (phi3_config(), 128, 30),
    "phi3-partial-rotary": (phi3_config(partial_rotary_factor=0.5, sliding_window=8), 128, 30),
    # the engine's context beyond original_max_position_embeddings: the long factors
    "phi3-longrope-long": (phi3_config(original_max_position_embeddings=16,
                                       rope_scaling=dict(LONGROPE)), 128, 30),
    # a context within it: the short factors (prompt within it too)
    "phi3-longrope-short": (phi3_config(original_max_position_embeddings=16,
                                        rope_scaling=dict(LONGROPE)), 16, 14),
}


def hf_model(config: Any, seed: int = 1) -> transformers.PreTrainedModel:
    """Weights N(0, 0.15); norm weights drawn too (Gemma's around its offset of one)."""
    gemma = config.model_type.startswith("gemma")
    return tiny_hf_model(config, std=0.15, norms=(-0.5, 0.5) if gemma else (0.5, 1.5),
                         seed=seed)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str) -> None:
    config, context, n = CASES[case]
    hf = hf_model(config)
    ours = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", context)
    assert type(ours).__name__ == config.architectures[0]
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ref.std() > 0.1, "random weights too small to make a meaningful comparison"
    torch.testing.assert_close(run_ours(ours, ids, [n]), ref, rtol=0, atol=1e-4)
    # Chunked prefill, then token-by-token decode through the cache.
    chunks = [7, 4, 1, 2] + [1] * (n - 14)
    torch.testing.assert_close(run_ours(ours, ids, chunks), ref, rtol=0, atol=1e-4)


def test_gemma_layers_alternate_and_carry_their_settings() -> None:
    g2 = build_model(*_weights(gemma2_config()), torch.float32, "cpu", 64)
    g3 = build_model(*_weights(gemma3_config()), torch.float32, "cpu", 64)
    assert isinstance(g2, Gemma2ForCausalLM) and isinstance(g3, Gemma3ForCausalLM)
    for model in (g2, g3):
        attns = [layer.self_attn for layer in model.gemma_layers]
        assert [a.sliding_window for a in attns] == [8, None, 8, None]
        assert all(a.scale == 24**-0.5 for a in attns)
        assert not model.fused_decode_enabled  # extra norms and GeGLU: the per-op path
    assert {a.softcap for a in (layer.self_attn for layer in g2.gemma_layers)} == {3.0}
    # transformers' Gemma 3 leaves attn_logit_softcapping unapplied
    assert all(layer.self_attn.softcap is None for layer in g3.gemma_layers)
    assert isinstance(g3.gemma_layers[0].self_attn.q_norm, GemmaRMSNorm)
    assert g3.local_rotary.cos.shape == g3.rotary.cos.shape == (64, 8)
    assert not torch.equal(g3.local_rotary.cos, g3.rotary.cos)  # two rotary bases
    g3.ensure_max_position(100)
    assert g3.local_rotary.max_position == g3.rotary.max_position == 100


def _weights(config: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    hf = hf_model(config)
    return hf.config, hf.state_dict()


def test_gemma_norm_matches_transformers_in_bfloat16_bit_for_bit() -> None:
    """(1 + w) multiplies in float32 before the cast: a bf16 copy of 1 + w would not."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 64, generator=g) * 3).bfloat16()
    w = (torch.randn(64, generator=g) * 0.3).bfloat16()
    ref_norm = Gemma2RMSNorm(64, eps=1e-6).bfloat16()
    ours = GemmaRMSNorm(64, 1e-6).bfloat16()
    with torch.no_grad():
        ref_norm.weight.copy_(w)
        ours.weight.copy_(w)
        res = torch.randn(5, 64, generator=g).bfloat16()
        assert torch.equal(ours(x), ref_norm(x))
        normed, stream = ours(x, res)
        assert torch.equal(stream, res + x) and torch.equal(normed, ref_norm(res + x))


def test_gemma_final_softcap_bounds_logits_and_skips_the_argmax_head() -> None:
    model = build_model(*_weights(gemma2_config()), torch.float32, "cpu", 64)
    hidden = torch.randn(3, 64) * 50
    logits = model.compute_logits(hidden)
    assert logits is not None and logits.abs().max() <= 5.0
    assert model.compute_greedy(hidden) is None


def test_gemma3_bidirectional_config_is_refused() -> None:
    config, weights = _weights(gemma3_config())
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        build_model(config, weights, torch.float32, "cpu", 64)


def test_gemma_activation_other_than_gelu_tanh_is_refused() -> None:
    config, weights = _weights(gemma2_config())
    config.hidden_activation = "relu"
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        build_model(config, weights, torch.float32, "cpu", 64)


def test_registry_picks_native_for_gemma_and_phi3() -> None:
    for config, cls in ((gemma2_config(), Gemma2ForCausalLM), (gemma3_config(), Gemma3ForCausalLM),
                        (phi3_config(), Phi3ForCausalLM)):
        assert get_model_class(config) is cls
        assert resolve_model_impl(config, "auto") == "tandem"
        config.architectures = None  # a hand-built config: the model_type decides
        assert get_model_class(config) is cls


def test_phi3_loads_its_fused_checkpoint_tensors_and_names_a_bad_one() -> None:
    config, weights = _weights(phi3_config())
    model = build_model(config, weights, torch.float32, "cpu", 64)
    layer = model.model.decoder_layers[1]
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    gate_up = "model.layers.1.mlp.gate_up_proj.weight"
    assert torch.equal(layer.self_attn.qkv_proj.weight, weights[qkv])
    assert torch.equal(layer.mlp.gate_up_proj.weight, weights[gate_up])
    bad = dict(weights)
    bad[gate_up] = bad[gate_up][:-2]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        build_model(config, bad, torch.float32, "cpu", 64)
    del bad[gate_up]
    with pytest.raises(ValueError, match="gate_up_proj"):
        build_model(config, bad, torch.float32, "cpu", 64)


def test_phi3_partial_rotary_declines_the_fused_decode_kernel() -> None:
    assert build_model(*_weights(phi3_config()), torch.float32, "cpu", 64).fused_decode_enabled
    partial = build_model(*_weights(phi3_config(partial_rotary_factor=0.5)), torch.float32,
                          "cpu", 64)
    assert not partial.fused_decode_enabled and partial.rotary.head_dim == 8


def test_longrope_tables_match_transformers() -> None:
    """Short and long factors by the context served, and the attention factor on both."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = phi3_config(original_max_position_embeddings=16, rope_scaling=dict(LONGROPE))
    rotary_dim, theta, scaling = phi3_rope(config)
    assert scaling is not None and scaling["factor"] == 16.0  # 256 / 16
    init = ROPE_INIT_FUNCTIONS["longrope"]
    for context, seq_len in ((16, None), (17, 17)):
        want, attention = init(config, "cpu", seq_len=seq_len)
        assert torch.equal(compute_inv_freq(rotary_dim, theta, scaling, context), want)
        assert rope_attention_factor(scaling) == attention
        table = RotaryEmbedding(rotary_dim, context, theta, scaling)
        pos = torch.arange(context, dtype=torch.float32)
        assert torch.equal(table.cos, torch.outer(pos, want).cos() * attention)
    assert rope_attention_factor({**scaling, "attention_factor": 1.5}) == 1.5
    assert rope_attention_factor({**scaling, "factor": 1.0}) == 1.0


def test_partial_rotary_passes_the_rest_through() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    cos, sin = RotaryEmbedding(8, 32, 10000.0).cos_sin(torch.arange(5))
    q2, k2 = rotary_embedding(q, k, cos, sin)
    assert torch.equal(q2[..., 8:], q[..., 8:]) and torch.equal(k2[..., 8:], k[..., 8:])
    full_q, full_k = rotary_embedding(q[..., :8].contiguous(), k[..., :8].contiguous(), cos, sin)
    assert torch.equal(q2[..., :8], full_q) and torch.equal(k2[..., :8], full_k)
    with pytest.raises(ValueError, match="head_dim"):
        rotary_embedding(q, k, *RotaryEmbedding(32, 32, 10000.0).cos_sin(torch.arange(5)))
