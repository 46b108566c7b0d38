"""The Transformers modeling backend (``model_impl="transformers"``) on tiny random-weight
models of architectures tandem has no native implementation of.

Each model is built by transformers from its config class (no download), saved as a
local Hugging Face folder and served by ``LLM(model_impl="transformers")``. Oracle:
transformers' own ``generate(do_sample=False)`` in float32, token for token, on prompts
that go through chunked prefill (16-token steps), a KV cache small enough to preempt, and
again with prefix-cache hits.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch
import transformers
from memory_connector import MemoryKVStore, register_memory_connector
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.models.transformers_backend import TransformersForCausalLM

VOCAB = 256
MAX_LEN = 256
NEW_TOKENS = 8
PROMPT_LENS = [1, 3, 17, 45]
MOE = {"num_experts_per_tok": 2}

#: architecture -> (config class, its sizes beyond the common ones, weight std)
ARCHS: dict[str, tuple[str, dict[str, Any], float]] = {
    "LlamaForCausalLM": ("LlamaConfig", {}, 0.2),
    # alternating sliding (window 8) and global layers, attention and final softcapping
    "Gemma2ForCausalLM": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8}, 0.05),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8}, 0.05),
    "Phi3ForCausalLM": ("Phi3Config", {}, 0.2),
    "Olmo2ForCausalLM": ("Olmo2Config", {}, 0.2),
    # embedding, residual, attention and logit multipliers
    "GraniteForCausalLM": ("GraniteConfig", {}, 0.2),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig",
                            {"num_experts": 4, "moe_intermediate_size": 32, **MOE}, 0.2),
    "MixtralForCausalLM": ("MixtralConfig",
                           {"num_local_experts": 4, "sliding_window": 8, **MOE}, 0.2),
    # attention sinks, every other layer sliding
    "GptOssForCausalLM": ("GptOssConfig", {"num_local_experts": 4, "sliding_window": 8,
                                           "head_dim": 16, **MOE}, 0.2),
    # head_dim 24: not a power of two
    "StableLmForCausalLM": ("StableLmConfig", {"hidden_size": 96}, 0.1),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", {"num_key_value_heads": None}, 0.1),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {"sliding_window": 8}, 0.1),
    "CohereForCausalLM": ("CohereConfig", {}, 0.2),
    # MLA as transformers computes it: K of 24 (16 + 8 rotary), V of 12 (zero-padded)
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", {
        "num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        **MOE}, 0.2),
}


def test_verified_list_is_what_this_module_checks() -> None:
    """docs/models.md lists ``TRANSFORMERS_VERIFIED`` as checked here: the same set."""
    from tandem.engine.models.support import TRANSFORMERS_VERIFIED

    assert sorted(ARCHS) == sorted(TRANSFORMERS_VERIFIED)


def tiny_transformers_config(arch: str) -> transformers.PretrainedConfig:
    """The tiny config of ``arch``: 2 layers, hidden 64, 4 heads (2 KV), vocabulary 256,
    no special tokens, with ``ARCHS``' overrides (a ``None`` drops the field)."""
    cls, extra, _ = ARCHS[arch]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": MAX_LEN, "architectures": [arch],
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **extra,
    }
    dropped = {k for k, v in extra.items() if v is None}
    return getattr(transformers, cls)(**{k: v for k, v in kwargs.items() if k not in dropped})


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(ARCHS), ids=list(ARCHS))
def tiny(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel]:
    arch = request.param
    folder = str(tmp_path_factory.mktemp(arch))
    hf = tiny_hf_model(tiny_transformers_config(arch), std=ARCHS[arch][2],
                       seed=zlib.crc32(arch.encode()) % 1000)
    hf.save_pretrained(folder)
    return folder, hf


def test_greedy_matches_transformers_with_chunks_preemption_and_prefix_hits(tiny) -> None:
    """Every prompt's greedy tokens equal transformers' ``generate``: in one batch with
    16-token chunked prefill in a cache too small for all (preemption), then again on
    the same engine (prefix-cache hits)."""
    folder, hf = tiny
    llm = LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, block_size=4, num_blocks=18,
              max_num_batched_tokens=16, model_impl="transformers")
    core = llm.llm_engine.engine_core
    assert isinstance(core.executor.driver_worker.model_runner.model, TransformersForCausalLM)
    assert core.model_facts.model_impl == "transformers"
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    first = llm.generate(ps, params, use_tqdm=False)
    assert core.get_stats().num_preemptions > 0, "the small KV cache must force preemption"
    again = llm.generate(ps, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) >= 16  # full blocks the cache kept
    # weights that saturate the model give one token everywhere: no test of the layers
    assert len({t for o in first for t in o.outputs[0].token_ids}) >= 8
    for prompt, a, b in zip(ps, first, again, strict=True):
        ref, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(a.outputs[0].token_ids), ref, logits)
        assert_matches_hf(list(b.outputs[0].token_ids), ref, logits)


def test_transformers_impl_equals_native_llama(tmp_path) -> None:
    """``model_impl="transformers"`` on a Llama gives the native implementation's float32
    greedy tokens, and both engines describe the same KV layout (same fingerprint): a
    decode engine of one implementation continues from blocks the other prefilled."""
    hf = tiny_hf_model(tiny_transformers_config("LlamaForCausalLM"), std=0.2, seed=11)
    hf.save_pretrained(tmp_path)
    ps = prompts() + [list(range(60))]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = {}
    for impl in ("tandem", "transformers"):
        llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=MAX_LEN,
                  kv_cache_memory=4 << 20, model_impl=impl)
        outs[impl] = [list(o.outputs[0].token_ids) for o in llm.generate(ps, params,
                                                                         use_tqdm=False)]
    assert outs["tandem"] == outs["transformers"]

    store = MemoryKVStore()
    name = register_memory_connector(store)

    def engine(impl: str, role: str) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=MAX_LEN,
                              model_impl=impl),  # type: ignore[arg-type]
            cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
            kv_transfer=KVTransferConfig(kv_connector=name, kv_role=role),  # type: ignore[arg-type]
        ))

    prefill, decode = engine("tandem", "kv_producer"), engine("transformers", "kv_consumer")
    assert prefill.engine_core.layout.fingerprint == decode.engine_core.layout.fingerprint
    prompt = ps[-1]
    for eng, n in ((prefill, 1), (decode, 12)):
        eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=n))
        while eng.has_unfinished_requests():
            done = [o for o in eng.step() if o.finished]
    assert done[0].num_cached_tokens == len(prompt) - 1  # loaded from the native prefill
    assert list(done[0].outputs[0].token_ids) == outs["tandem"][-1]


def test_mla_cache_holds_padded_v(tmp_path) -> None:
    """DeepSeek-V3 through transformers' code: the cache geometry is the probed one (K/V
    expanded to every head, head size max(24, 12)), and it is the layout fingerprinted.
    (``auto`` takes the native MLA implementation, whose cache is the latent:
    tests/e2e/test_llm_mla.py.)"""
    hf = tiny_hf_model(tiny_transformers_config("DeepseekV3ForCausalLM"), std=0.2, seed=2)
    hf.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=MAX_LEN,
              kv_cache_memory=1 << 20, model_impl="transformers")
    core = llm.llm_engine.engine_core
    assert (core.model_facts.num_kv_heads, core.model_facts.head_dim) == (4, 24)
    assert core.layout.head_dim == 24 and core.model_facts.model_impl == "transformers"
