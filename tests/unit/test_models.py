"""Our model implementations against transformers on tiny random-weight configs.

float32 logits of our Llama / Mistral / Qwen2 / Qwen3 (tied and untied embeddings)
must match the transformers model's to ~1e-4, whole-prompt and chunked through the
paged cache; plus weight mapping, registry and loader errors.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import tiny_config, tiny_hf_model

from tandem.engine.config import ModelConfig
from tandem.engine.model_facts import kv_cache_spec
from tandem.engine.model_loader import load_model, resolve_dtype
from tandem.engine.models.registry import build_model, get_model_class, supported_architectures
from tandem.kernels.attention import build_attention_metadata
from tandem.kernels.cache import allocate_kv_cache, kv_cache_layer_views

#: architecture -> its config's extra settings
ARCHS = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": 12},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 24},
    # The native MoE families (engine/models/moe_models.py, gpt_oss.py): 8 experts, top-2.
    "Qwen3MoeForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 16, "norm_topk_prob": True},
    "Qwen2MoeForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24},
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "GptOssForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2,
                          "sliding_window": 12},
    # engine/models/gemma.py, phi3.py (their own tests: tests/unit/test_models_gemma_phi3.py)
    "Gemma2ForCausalLM": {"head_dim": 8, "sliding_window": 12, "query_pre_attn_scalar": 12},
    "Gemma3ForCausalLM": {"head_dim": 8, "sliding_window": 12,
                          "layer_types": ["sliding_attention", "full_attention"]},
    "Phi3ForCausalLM": {"partial_rotary_factor": 0.5, "pad_token_id": None},
    # engine/models/deepseek.py (MLA; its own tests: tests/e2e/test_llm_mla.py): a dense
    # layer, then a MoE one
    "DeepseekV3ForCausalLM": {"kv_heads": 6, "kv_lora_rank": 16, "q_lora_rank": 12,
                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
                              "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                              "topk_group": 1, "moe_intermediate_size": 16,
                              "first_k_dense_replace": 1},
    "DeepseekV2ForCausalLM": {"kv_heads": 6, "kv_lora_rank": 16, "q_lora_rank": None,
                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
                              "n_routed_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 16, "first_k_dense_replace": 1},
}
SIZES = {"vocab": 97, "hidden": 48, "ffn": 80, "heads": 6, "max_len": 128}


def make_hf_model(arch: str, tie: bool, seed: int = 0):
    """A tiny transformers model with random weights (biases and norms too)."""
    config = tiny_config(arch, **SIZES, tie_word_embeddings=tie, **ARCHS[arch])
    return tiny_hf_model(config, std=0.15, norms=(0.5, 1.5), seed=seed)


def run_ours(model, token_ids: list[int], chunks: list[int], block_size: int = 4):
    """Feed ``token_ids`` in chunks through the paged cache; logits of every token."""
    cfg = model.config
    spec = kv_cache_spec(cfg)  # per-head K/V, or an MLA model's latent
    kv = allocate_kv_cache(32, cfg.num_hidden_layers, block_size, spec.num_kv_heads,
                           spec.head_dim, torch.float32, num_components=spec.num_components)
    views = kv_cache_layer_views(kv)
    table = [31 - i for i in range(32)]  # reversed physical order on purpose
    logits, done = [], 0
    with torch.inference_mode():
        for n in chunks:
            meta = build_attention_metadata([n], [done], [table], block_size)
            ids = torch.tensor(token_ids[done : done + n])
            logits.append(model.compute_logits(model(ids, meta.positions, views, meta)))
            done += n
    return torch.cat(logits)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_logits_match_transformers(arch, tie):
    hf = make_hf_model(arch, tie)
    ours = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 128)
    assert (ours.lm_head is None) == tie
    token_ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    assert ref.std() > 0.1, "random weights too small to make a meaningful comparison"
    whole = run_ours(ours, token_ids, [30])
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-4)
    # Chunked prefill then token-by-token decode through the cache.
    chunked = run_ours(ours, token_ids, [7, 9, 1, 5] + [1] * 8)
    torch.testing.assert_close(chunked, ref, rtol=0, atol=1e-4)


def test_qwen2_has_qkv_bias_and_qwen3_qk_norm():
    qwen2 = build_model(
        make_hf_model("Qwen2ForCausalLM", False).config,
        make_hf_model("Qwen2ForCausalLM", False).state_dict(),
        torch.float32,
        "cpu",
        128,
    )
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    hf3 = make_hf_model("Qwen3ForCausalLM", False)
    qwen3 = build_model(hf3.config, hf3.state_dict(), torch.float32, "cpu", 128)
    torch.testing.assert_close(
        qwen3.model.layers[1].self_attn.k_norm.weight,
        hf3.model.layers[1].self_attn.k_norm.weight.detach(),
    )


def test_unsupported_architecture_names_it_and_lists_supported():
    config = transformers.GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as err:
        get_model_class(config)
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in supported_architectures():
        assert arch in str(err.value)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight",
                                  "model.layers.1.self_attn.k_proj.weight",
                                  "model.layers.0.input_layernorm.weight"])
def test_missing_weight_is_reported(name):
    """A missing part of a fused projection is named as the checkpoint names it (it was
    named by tandem's internal fused parameter, ``...qkv_proj.weight``)."""
    import re

    hf = make_hf_model("LlamaForCausalLM", False)
    state = dict(hf.state_dict())
    del state[name]
    with pytest.raises(ValueError, match=re.escape(f"checkpoint: ['{name}']")):
        build_model(hf.config, state, torch.float32, "cpu", 128)


def test_load_local_hf_folder(tmp_path):
    hf = make_hf_model("Qwen2ForCausalLM", True, seed=5)
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors, no tokenizer
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=64))
    assert loaded.model_id == tmp_path.name
    assert loaded.dtype == torch.float32 and loaded.tokenizer is None
    assert type(loaded.model).__name__ == "Qwen2ForCausalLM"
    token_ids = list(range(3, 20))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(run_ours(loaded.model, token_ids, [17]), ref, rtol=0, atol=1e-4)


def test_load_bfloat16_weights(tmp_path):
    hf = make_hf_model("LlamaForCausalLM", False)
    hf.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16", max_model_len=64))
    assert loaded.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())


def test_unknown_model_path_names_model(tmp_path):
    with pytest.raises(ValueError, match="model"):
        load_model(ModelConfig(model=str(tmp_path / "nope")))


def test_unsupported_architecture_fails_at_load(tmp_path):
    transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]
    ).save_pretrained(tmp_path)
    # No native GPT-2: model_impl="tandem" refuses it, naming the other implementation.
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*model_impl='auto' or 'transformers'"):
        load_model(ModelConfig(model=str(tmp_path), model_impl="tandem"))


def test_unknown_model_type_is_one_clear_error(tmp_path):
    """A model_type transformers has no class for: one error naming the architecture (it
    was transformers' own, which asks the user to upgrade transformers)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "foobar", "architectures": ["FooBarForCausalLM"]}))
    with pytest.raises(ValueError, match=r"^model architecture 'FooBarForCausalLM' "
                                         r"\(model_type 'foobar'\) is not supported") as err:
        load_model(ModelConfig(model=str(tmp_path)))
    assert "pip install" not in str(err.value)


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    from tandem.engine.model_loader import cpu_supports_bf16

    expected = torch.bfloat16 if cpu_supports_bf16() else torch.float32
    assert resolve_dtype("auto", cpu) == expected
    # The bench passes the device as a string.
    assert resolve_dtype("auto", "cpu") == expected


def test_llama3_rope_scaling_matches_transformers():
    config = tiny_config(
        "LlamaForCausalLM",
        **SIZES,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    hf = tiny_hf_model(config, std=0.15)
    ours = build_model(config, hf.state_dict(), torch.float32, "cpu", 128)
    token_ids = list(range(5, 45))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(run_ours(ours, token_ids, [25, 15]), ref, rtol=0, atol=1e-4)


def test_bfloat16_model_tracks_float32_logits():
    hf = make_hf_model("Qwen3ForCausalLM", True)
    ours = build_model(hf.config, hf.state_dict(), torch.bfloat16, "cpu", 128)
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    token_ids = list(range(10, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    cfg = ours.config
    kv = allocate_kv_cache(
        16, cfg.num_hidden_layers, 4, cfg.num_key_value_heads, 24, torch.bfloat16
    )
    views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(cfg.num_hidden_layers)]
    meta = build_attention_metadata([30], [0], [list(range(8))], 4)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(torch.tensor(token_ids), meta.positions, views, meta))
    assert logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits: compare relative to the logits' spread.
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("arch", supported_architectures())
def test_every_registered_model_implements_the_seam(arch):
    """The runner talks to models only through ``CausalLM`` (engine/models/interface.py)."""
    from tandem.engine.models.interface import CausalLM

    model = build_model(make_hf_model(arch, tie=False).config,
                        make_hf_model(arch, tie=False).state_dict(), torch.float32, "cpu", 64)
    assert isinstance(model, CausalLM)
    assert model.max_position == 64
    model.ensure_max_position(32)  # never shrinks
    assert model.max_position == 64
    model.ensure_max_position(128)
    assert model.max_position == 128


def test_architecture_name_of_configs_without_architectures():
    """A GGUF-derived config names no ``architectures``; its facts still name one (they
    said ``null`` in /v1/models for the default model)."""
    from tandem.engine.models.registry import architecture_name

    assert architecture_name(transformers.LlamaConfig()) == "LlamaForCausalLM"
    assert architecture_name(transformers.Olmo2Config()) == "Olmo2ForCausalLM"
    named = transformers.LlamaConfig(architectures=["MistralForCausalLM"])
    assert architecture_name(named) == "MistralForCausalLM"
