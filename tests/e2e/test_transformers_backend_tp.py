"""Tensor parallelism of the Transformers modeling backend (``model_impl="transformers"``,
``tensor_parallel_size=2``: the "mp" executor, one worker process per rank, gloo on the
CPU) against transformers' greedy ``generate`` in float32, token for token.

Each architecture is split by its config's ``base_model_tp_plan`` (``transformers_tp``):
Llama (separate q/k/v), GPT-NeoX (one fused per-head QKV projection, biases on every
split linear), Starcoder2 (biased ``c_fc`` / ``c_proj``) and Qwen3-MoE (per-head q/k
norms and the experts kept whole). Each rank's cache holds its KV heads only; a Llama
prompt prefilled by the TP engine continues on a one-rank engine from the KV store.
"""

from __future__ import annotations

import os
import zlib

import pytest
import transformers
from memory_connector import MemoryKVStore, register_memory_connector
from test_llm_tiny_models import assert_matches_hf
from test_transformers_backend import ARCHS, MAX_LEN, prompts, tiny_transformers_config
from tiny_models import hf_greedy_steps, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
)
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.models.support import TRANSFORMERS_TP_VERIFIED

NEW_TOKENS = 8
TP_ARCHS = ("LlamaForCausalLM", "GPTNeoXForCausalLM", "Starcoder2ForCausalLM",
            "Qwen3MoeForCausalLM")

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


def test_tp_list_is_what_this_module_checks() -> None:
    """docs/models.md marks ``TRANSFORMERS_TP_VERIFIED`` TP=yes as checked here."""
    assert sorted(TP_ARCHS) == sorted(TRANSFORMERS_TP_VERIFIED)


@pytest.fixture(scope="module", params=TP_ARCHS, ids=TP_ARCHS)
def tiny(request, tmp_path_factory) -> tuple[str, transformers.PreTrainedModel]:
    arch = request.param
    folder = str(tmp_path_factory.mktemp(f"tp-{arch}"))
    hf = tiny_hf_model(tiny_transformers_config(arch), std=ARCHS[arch][2],
                       seed=zlib.crc32(arch.encode()) % 1000)
    hf.save_pretrained(folder)
    return folder, hf


def test_tp2_greedy_matches_transformers(tiny) -> None:
    """At TP=2, with 16-token chunked prefill in a cache small enough to preempt: every
    prompt's tokens equal transformers' ``generate``; rank r's cache holds KV heads
    ``[r * n / 2, (r + 1) * n / 2)`` and both ranks all-reduced."""
    folder, hf = tiny
    with LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, block_size=4, num_blocks=18,
             max_num_batched_tokens=16, model_impl="transformers",
             tensor_parallel_size=2) as llm:
        core = llm.llm_engine.engine_core
        assert core.model_facts.model_impl == "transformers"
        kv = core.model_facts.num_kv_heads
        assert kv == (getattr(hf.config, "num_key_value_heads", None)
                      or hf.config.num_attention_heads)
        infos = core.executor.shard_infos
        assert [info["kv_head_range"] for info in infos] == [range(0, kv // 2),
                                                             range(kv // 2, kv)]
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts(), params, use_tqdm=False)
        assert core.get_stats().num_preemptions > 0, "the small KV cache must force preemption"
        for stats in core.executor.collective_stats():
            assert stats["all_reduce"]["calls"] > 0
    assert len({t for o in outs for t in o.outputs[0].token_ids}) >= 8
    for prompt, out in zip(prompts(), outs, strict=True):
        ref, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(out.outputs[0].token_ids), ref, logits)


def test_tp2_prefill_continues_on_one_rank(tmp_path) -> None:
    """A Llama prompt prefilled at TP=2 (each rank's cache its KV head) is saved to the
    KV store by heads, loaded by a one-rank decode engine, and the continuation equals
    transformers' greedy tokens: the ranks' caches hold the heads they claim."""
    hf = tiny_hf_model(tiny_transformers_config("LlamaForCausalLM"), std=0.2, seed=11)
    hf.save_pretrained(tmp_path)
    store = MemoryKVStore()
    name = register_memory_connector(store)

    def engine(tp: int, role: str) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=ModelConfig(model=str(tmp_path), dtype="float32", max_model_len=MAX_LEN,
                              model_impl="transformers"),  # type: ignore[arg-type]
            cache=CacheConfig(kv_cache_memory_bytes=4 << 20),
            parallel=ParallelConfig(tensor_parallel_size=tp),
            kv_transfer=KVTransferConfig(kv_connector=name, kv_role=role),  # type: ignore[arg-type]
        ))

    prompt = list(range(3, 63))
    prefill, decode = engine(2, "kv_producer"), engine(1, "kv_consumer")
    try:
        assert prefill.engine_core.layout.fingerprint == decode.engine_core.layout.fingerprint
        for eng, n in ((prefill, 1), (decode, 12)):
            eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=n))
            while eng.has_unfinished_requests():
                done = [o for o in eng.step() if o.finished]
    finally:
        prefill.engine_core.shutdown()
    assert done[0].num_cached_tokens == len(prompt) - 1  # loaded from the TP prefill
    ref, logits = hf_greedy_steps(hf, prompt, 12)
    assert_matches_hf(list(done[0].outputs[0].token_ids), ref, logits)
