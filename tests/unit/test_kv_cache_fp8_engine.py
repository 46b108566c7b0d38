"""``LLM(kv_cache_dtype="fp8")`` on a tiny random-weight Llama: close to the ``auto`` cache
by vLLM's rule with chunked prefill, prefix hits and preemption; about twice the blocks
(four times, for a float32 model) in the same memory; a layout of its own (the store keys
of FP8 blocks never match an ``auto`` engine's); an FP8 prefill -> store -> FP8 decode
equal to colocated FP8; bad input refused."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_steps import run
from memory_connector import MemoryKVStore, register_memory_connector
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.llm import LLM
from tandem.engine.model_loader import LoadedModel
from tandem.engine.models.registry import build_model
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

VOCAB, MAX_LEN, BLOCK = 97, 128, 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny_hf():
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=96, max_len=MAX_LEN,
                         special_tokens=False)
    return tiny_hf_model(config, std=0.5)


@pytest.fixture(scope="module")
def tiny(tiny_hf) -> LoadedModel:
    # NOTE: a random model's next-token distribution is nearly flat; std 0.5 gives it gaps
    # that e4m3's rounding (3 mantissa bits) is measured against, as a trained model has.
    return as_loaded_model(tiny_hf, "tiny-llama", MAX_LEN)


def close_by_vllm_rule(a, b, k: int = 5) -> bool:
    """vLLM's ``check_logprobs_close``: equal greedy tokens, or at the first position where
    they differ each side's token is in the other's top-``k`` logprobs."""
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if ta != tb:
            return tb in a.logprobs[i] and ta in b.logprobs[i]
    return True


def _generate(llm: LLM, prompts: list[list[int]], n: int = 12):
    params = SamplingParams(temperature=0.0, max_tokens=n, logprobs=5, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


PREFIX = list(range(3, 23))
PROMPTS = [PREFIX + [30 + i, 40 + i, 50 + i] for i in range(4)] + [list(range(60, 93))]


def test_fp8_close_to_auto_with_chunks_prefix_hits_and_preemption(tiny) -> None:
    common = dict(dtype="float32", loaded=tiny, block_size=BLOCK, max_model_len=MAX_LEN,
                  max_num_batched_tokens=16, max_num_seqs=8)
    auto = LLM(num_blocks=256, **common)
    want = _generate(auto, PROMPTS)
    # a cache too small for every sequence at once: the scheduler preempts and recomputes
    fp8 = LLM(kv_cache_dtype="fp8", num_blocks=30, **common)
    got = _generate(fp8, PROMPTS)
    core = fp8.llm_engine.engine_core
    assert core.get_stats().num_preemptions > 0
    again = _generate(fp8, PROMPTS[:2])  # the shared prefix now from the prefix cache
    assert core.get_stats().prefix_cache_hits > 0
    for w, g in zip(want, got, strict=True):
        assert close_by_vllm_rule(w, g)
    # recompute and prefix hits see exactly what the cache gave back the first time
    assert [o.token_ids for o in again] == [o.token_ids for o in got[:2]]
    # e5m2 (2 mantissa bits) runs the same paths; its first token stays close
    e5m2 = _generate(LLM(kv_cache_dtype="fp8_e5m2", num_blocks=256, **common), PROMPTS, 1)
    for w, g in zip(want, e5m2, strict=True):
        assert close_by_vllm_rule(w, g)


def test_deterministic_mode_keeps_batch_invariance(tiny) -> None:
    common = dict(dtype="float32", loaded=tiny, block_size=BLOCK, max_model_len=MAX_LEN,
                  num_blocks=256, kv_cache_dtype="fp8", deterministic=True)
    llm = LLM(**common)
    batched = _generate(llm, PROMPTS, 8)
    alone = [_generate(llm, [p], 8)[0] for p in PROMPTS[:2]]
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched[:2]]


def _bf16(hf) -> LoadedModel:
    model = build_model(hf.config, hf.state_dict(), torch.bfloat16, "cpu", MAX_LEN)
    return LoadedModel(model=model, hf_config=hf.config, tokenizer=None,
                       model_id="tiny-llama", dtype=torch.bfloat16, device=torch.device("cpu"),
                       eos_token_id=None, max_position=MAX_LEN)


def _core(loaded: LoadedModel, cache_dtype: str = "auto", **kw: object) -> EngineCore:
    cache = dict(block_size=BLOCK, cache_dtype=cache_dtype)
    cache.update({k: kw.pop(k) for k in ("kv_cache_memory_bytes",) if k in kw})
    if "kv_cache_memory_bytes" not in cache:
        cache["num_blocks_override"] = 64
    dtype = str(loaded.dtype).removeprefix("torch.")
    config = EngineConfig(
        model=ModelConfig(dtype=dtype, max_model_len=MAX_LEN),  # type: ignore[arg-type]
        cache=CacheConfig(**cache),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        kv_transfer=KVTransferConfig(**kw) if kw else KVTransferConfig(),  # type: ignore[arg-type]
    )
    return EngineCore(config, create_executor(config, loaded))


def test_twice_the_blocks_in_the_same_memory_and_a_layout_of_its_own(tiny, tiny_hf) -> None:
    bf16 = _bf16(tiny_hf)
    budget = 1 << 20
    auto = _core(bf16, kv_cache_memory_bytes=budget)
    fp8 = _core(bf16, "fp8", kv_cache_memory_bytes=budget)
    assert fp8.num_blocks == 2 * auto.num_blocks
    assert fp8.kv_cache_bytes_per_token * 2 == auto.kv_cache_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert fp8.executor.driver_worker.kv_cache.dtype == torch.float8_e4m3fn
    # the auto layout's fingerprint is what it always was; the FP8 one differs
    assert auto.layout == KVCacheLayout("tiny-llama", 2, 2, 16, "bfloat16", BLOCK)
    assert fp8.layout.dtype == "float8_e4m3fn" and fp8.layout.kv_scales
    assert fp8.layout.fingerprint != auto.layout.fingerprint
    assert fp8.layout.block_bytes * 2 == auto.layout.block_bytes
    other_scales = KVCacheLayout("tiny-llama", 2, 2, 16, "float8_e4m3fn", BLOCK,
                                 kv_scales="0" * 16)
    assert other_scales.fingerprint != fp8.layout.fingerprint
    # a float32 model's FP8 cache holds four times the tokens
    f32 = _core(tiny, "fp8_e5m2", kv_cache_memory_bytes=budget)
    assert f32.num_blocks == 4 * _core(tiny, kv_cache_memory_bytes=budget).num_blocks


def _request(prompt: list[int], n: int) -> Request:
    return Request(f"r{next(_ids)}", prompt, SamplingParams(temperature=0.0, max_tokens=n))


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_fp8_prefill_to_fp8_decode_equals_colocated(tiny) -> None:
    store = MemoryKVStore()
    name = register_memory_connector(store)
    producer = _core(tiny, "fp8", kv_connector=name, kv_role="kv_producer")
    consumer = _core(tiny, "fp8", kv_connector=name, kv_role="kv_consumer")
    prompt = list(range(30, 52))  # 5 full blocks and a partial one
    run(producer, _request(prompt, 1))
    assert len(store) == 6
    # the blocks moved are the FP8 cache's: half... here a quarter of the float32 bytes
    block = next(iter(store.blocks.values()))
    assert block.dtype == torch.float8_e4m3fn
    assert block.numel() * block.element_size() == producer.layout.block_bytes
    req = _request(prompt, 8)
    outs = run(consumer, req)[req.request_id]
    assert outs[0].num_cached_tokens >= 20  # loaded, not recomputed
    colocated = _core(tiny, "fp8")
    req2 = _request(prompt, 8)
    assert _tokens(outs) == _tokens(run(colocated, req2)[req2.request_id])


def test_bad_kv_cache_dtype_names_the_field(tiny) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(cache_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(dtype="float32", loaded=tiny, kv_cache_dtype="fp16")


def test_fp8_on_a_gpu_without_fp8_is_a_start_up_error(tiny, monkeypatch) -> None:
    from tandem.engine import model_runner

    runner = model_runner.ModelRunner.__new__(model_runner.ModelRunner)
    runner.dtype = torch.bfloat16
    runner.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"kv_cache_dtype: float8_e4m3fn needs a GPU"):
        runner._init_kv_cache_dtype("fp8")
