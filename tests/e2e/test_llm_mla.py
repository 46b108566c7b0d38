"""Offline ``LLM`` on tiny random-weight DeepSeek-V2/V3 models: multi-head latent attention
over tandem's paged latent cache (``engine/models/mla.py``, ``engine/models/deepseek.py``).

Oracle: transformers ``generate(do_sample=False)`` in float32, token for token
(``assert_matches_hf``: a first difference only at a near-tie). The configs exercise what
MLA adds: a low-rank query (V3) and a full one (V2), DeepSeek's YaRN with both mscales
(positions past ``original_max_position_embeddings``), interleaved and ``rotate_half``
rotary, a dense first layer and a MoE one (the native ``SparseMoeBlock``).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from memory_connector import MemoryKVStore, register_memory_connector
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.contracts.kv_layout import KVCacheLayout, KVCacheSpec
from tandem.engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.models.registry import build_model

VOCAB = 256
MAX_LEN = 256
NEW_TOKENS = 12
PROMPT_LENS = [1, 3, 16, 17, 45, 110]
RANK, ROPE, LAYERS = 32, 8, 2


def mla_config(arch: str, **extra: object) -> transformers.PretrainedConfig:
    """A tiny DeepSeek config: 4 heads, latent 32 + rotary 8, layer 0 dense, layer 1 MoE."""
    kw: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_LEN,
        kv_lora_rank=RANK, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=ROPE,
        v_head_dim=12, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        architectures=[arch], bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.8,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    kw.update(extra)
    return getattr(transformers, arch.replace("ForCausalLM", "Config"))(**kw)


CASES = {
    "v3": ("DeepseekV3ForCausalLM", {}),
    "v2-full-q": ("DeepseekV2ForCausalLM", {"q_lora_rank": None, "topk_method": "greedy"}),
    "v3-rotate-half": ("DeepseekV3ForCausalLM", {"rope_interleave": False, "q_lora_rank": None}),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def tiny(request, tmp_path_factory):
    arch, extra = CASES[request.param]
    folder = str(tmp_path_factory.mktemp(f"mla-{request.param}"))
    hf = tiny_hf_model(mla_config(arch, **extra), std=0.2, seed=3)
    hf.save_pretrained(folder)
    return folder, hf


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make_llm(folder: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 2 << 20)
    return LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, **kwargs)


def tokens(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]


def test_greedy_matches_transformers_and_cache_holds_the_latent(tiny) -> None:
    """Tokens equal transformers'; the cache is one latent entry per token and layer:
    ``(kv_lora_rank + qk_rope_head_dim) * 4 bytes * layers`` per token, not expanded K/V."""
    folder, hf = tiny
    llm = make_llm(folder, block_size=4)
    ps = prompts()
    for prompt, ours in zip(ps, tokens(llm, ps), strict=True):
        ref, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(ours, ref, logits)
    core = llm.llm_engine.engine_core
    runner = core.executor.driver_worker.model_runner
    assert runner.loaded.model_impl == "tandem"
    per_token = (RANK + ROPE) * 4 * LAYERS
    assert runner.block_bytes == per_token * 4
    assert tuple(runner.kv_cache.shape[1:]) == (LAYERS, 1, 4, 1, RANK + ROPE)
    assert runner.kv_cache.numel() * 4 == runner.num_blocks * runner.block_bytes
    layout = core.layout
    assert (layout.kind, layout.rope_dim, layout.block_bytes) == ("mla", ROPE, per_token * 4)


def test_engine_settings_do_not_change_tokens(tiny) -> None:
    """Chunked prefill (16-token steps), a prefix-cache hit and preemption (a cache too
    small for the batch) give the tokens of a plain run."""
    folder, _ = tiny
    ps = prompts()
    base = tokens(make_llm(folder, block_size=4, enable_prefix_caching=False), ps)
    chunked = make_llm(folder, enable_chunked_prefill=True, max_num_batched_tokens=16)
    assert tokens(chunked, ps) == base
    cached = make_llm(folder, block_size=4)
    assert tokens(cached, ps[-1:]) == base[-1:]
    again = cached.generate(ps[-1:], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
                            use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(ps[-1]) - 4
    assert list(again.outputs[0].token_ids) == base[-1]
    small = make_llm(folder, num_blocks=34, block_size=4, kv_cache_memory=None)
    assert tokens(small, ps) == base
    assert small.llm_engine.engine_core.get_stats().num_preemptions > 0


def test_prefill_to_decode_through_a_connector_equals_colocated(tiny) -> None:
    """A decode engine that loads the prompt's latent blocks from a prefill engine (the
    in-memory connector) computes only the last token and generates the colocated tokens;
    the blocks it moved are the latent's size."""
    folder, _ = tiny
    store = MemoryKVStore()
    name = register_memory_connector(store)
    ps = prompts()[3:]

    def engine(role: str) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=ModelConfig(model=folder, dtype="float32", max_model_len=MAX_LEN),
            cache=CacheConfig(kv_cache_memory_bytes=2 << 20, block_size=4),
            kv_transfer=KVTransferConfig(kv_connector=name, kv_role=role),  # type: ignore[arg-type]
        ))

    def run(eng: LLMEngine, max_tokens: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        for i, p in enumerate(ps):
            eng.add_request(str(i), p, params)
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        return [done[str(i)] for i in range(len(ps))]

    run(engine("kv_producer"), 1)
    assert len(store) > 0
    assert {b.nbytes for b in store.blocks.values()} == {(RANK + ROPE) * 4 * LAYERS * 4}
    outs = run(engine("kv_consumer"), NEW_TOKENS)
    colocated = tokens(make_llm(folder, block_size=4), ps)
    for p, out, want in zip(ps, outs, colocated, strict=True):
        assert out.num_cached_tokens == len(p) - 1
        assert list(out.outputs[0].token_ids) == want


def test_mla_fingerprint_differs_from_expanded_and_from_any_mha_layout(tiny) -> None:
    """The Transformers backend of the same checkpoint caches expanded per-head K/V (an
    "mha" layout): the two engines' blocks never share keys, and no "mha" geometry (not
    even one of the latent's bytes per block) has the MLA fingerprint."""
    folder, hf = tiny
    native = make_llm(folder, block_size=4).llm_engine.engine_core.layout
    generic = make_llm(folder, block_size=4, model_impl="transformers")
    g_layout = generic.llm_engine.engine_core.layout
    assert g_layout.kind == "mha" and g_layout.block_bytes > native.block_bytes
    assert g_layout.fingerprint != native.fingerprint
    ps = prompts()[:3]
    assert tokens(generic, ps) == tokens(make_llm(folder, block_size=4), ps)
    common = dict(model_id=native.model_id, num_layers=LAYERS, dtype="float32", block_size=4)
    for heads, dim in [(1, RANK + ROPE), (1, (RANK + ROPE) // 2), (4, 24), (1, RANK)]:
        mha = KVCacheLayout.of_spec(KVCacheSpec.mha(heads, dim), **common)
        assert mha.fingerprint != native.fingerprint
    assert native == KVCacheLayout.of_spec(KVCacheSpec.mla(RANK, ROPE), **common)


def test_load_errors_name_the_tensor(tiny) -> None:
    folder, hf = tiny
    state = dict(hf.state_dict())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    bad = {**state, name: state[name][:-1]}
    with pytest.raises(ValueError, match=f"weight '{name}' has shape"):
        build_model(hf.config, bad, torch.float32, "cpu", MAX_LEN)
    missing = {k: v for k, v in state.items() if "kv_a_layernorm" not in k}
    with pytest.raises(ValueError, match="missing from the checkpoint: .*kv_a_layernorm"):
        build_model(hf.config, missing, torch.float32, "cpu", MAX_LEN)
    extra = {**state, "model.layers.0.self_attn.kv_b_proj.weight_scale_inv": torch.ones(1)}
    with pytest.raises(ValueError, match="kv_b_proj.weight_scale_inv"):
        build_model(hf.config, extra, torch.float32, "cpu", MAX_LEN)
    moe = {**state, "model.layers.1.mlp.experts.99.up_proj.weight": torch.ones(32, 64)}
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.99.up_proj.weight"):
        build_model(hf.config, moe, torch.float32, "cpu", MAX_LEN)


def test_native_model_implements_the_seam(tiny) -> None:
    """The runner reaches the model only through ``CausalLM``; its rotary tables grow."""
    from tandem.engine.models.interface import CausalLM

    _, hf = tiny
    model = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 64)
    assert isinstance(model, CausalLM)
    assert (model.shard.kv_heads, model.shard.head_dim) == (range(1), RANK + ROPE)
    model.ensure_max_position(32)
    assert model.max_position == 64
    model.ensure_max_position(MAX_LEN)
    assert model.max_position == MAX_LEN and model.rotary.cos.shape == (MAX_LEN, ROPE // 2)
