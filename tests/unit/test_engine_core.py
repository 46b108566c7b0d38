"""EngineCore on a tiny random Llama: validation, the step loop, layout, KV connector."""

from __future__ import annotations

import itertools

import pytest
import transformers
from engine_steps import run
from memory_connector import MemoryKVStore, register_memory_connector
from tiny_models import as_loaded_model, hf_greedy_steps, tiny_config, tiny_hf_model

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
from tandem.engine.model_loader import LoadedModel
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

VOCAB = 97
MAX_LEN = 64
BLOCK = 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, transformers.PreTrainedModel]:
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=32, ffn=64, max_len=MAX_LEN,
                         special_tokens=False)
    hf = tiny_hf_model(config, std=0.3)
    return as_loaded_model(hf, "tiny-llama", MAX_LEN), hf


def make_core(loaded: LoadedModel, num_blocks: int = 32, **kv: object) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        kv_transfer=KVTransferConfig(**kv) if kv else KVTransferConfig(),
    )
    return EngineCore(config, create_executor(config, loaded))


def make_request(prompt: list[int], **params: object) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(f"r{next(_ids)}", prompt, SamplingParams(**params))


def assert_idle(core: EngineCore) -> None:
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.has_unfinished_requests()


def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    return hf_greedy_steps(hf, prompt, n)[0]


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], {}, "prompt_token_ids must not be empty"),
        (list(range(MAX_LEN)), {}, r"max_model_len 64 \(prompt_token_ids: 1..63"),
        ([1, VOCAB], {}, rf"prompt_token_ids .* {VOCAB} outside \[0, {VOCAB}\)"),
        ([-3, 1], {}, r"prompt_token_ids .* -3 outside"),
        ([1, 2], {"logit_bias": {VOCAB + 5: 1.0}}, "logit_bias token id"),
        ([1, 2], {"stop_token_ids": [VOCAB]}, "stop_token_ids entry"),
    ],
    ids=["empty", "too-long", "id-too-big", "id-negative", "logit-bias", "stop-token"],
)
def test_bad_requests_rejected_before_allocation(tiny, prompt, params, match) -> None:
    core = make_core(tiny[0])
    good = make_request([1, 2, 3], max_tokens=3)
    core.add_request(good)
    with pytest.raises(ValueError, match=match):
        core.add_request(make_request(prompt, **params))
    assert list(core.scheduler.requests) == [good.request_id]
    run(core)  # the engine keeps serving the good request
    assert good.num_output_tokens == 3
    assert_idle(core)


def test_duplicate_request_id_rejected(tiny) -> None:
    core = make_core(tiny[0])
    req = make_request([1, 2, 3], max_tokens=2)
    core.add_request(req)
    with pytest.raises(ValueError, match="request_id"):
        core.add_request(Request(req.request_id, [4, 5], SamplingParams()))
    run(core)
    assert_idle(core)


def test_step_outputs_match_transformers(tiny) -> None:
    loaded, hf = tiny
    core = make_core(loaded)
    prompts = [[5], [7, 8, 9, 10, 11], list(range(20, 39))]
    reqs = [make_request(p, max_tokens=6, logprobs=1) for p in prompts]
    outs = run(core, *reqs)
    for p, r in zip(prompts, reqs, strict=True):
        steps = outs[r.request_id]
        assert [t for o in steps for t in o.new_token_ids] == hf_greedy(hf, p, 6)
        assert [o.finish_reason for o in steps] == [None] * 5 + ["length"]
        assert all(o.new_logprobs and len(o.new_logprobs) == 1 for o in steps)
    assert core.num_steps >= 6
    assert_idle(core)


def test_max_tokens_none_runs_to_max_model_len(tiny) -> None:
    core = make_core(tiny[0])
    req = make_request(list(range(1, 61)), max_tokens=None)
    outs = run(core, req)[req.request_id]
    assert len(outs) == MAX_LEN - 60 and outs[-1].finish_reason == "length"
    assert req.sampling_params.max_tokens == MAX_LEN - 60
    assert_idle(core)


def test_abort_in_every_state(tiny) -> None:
    core = make_core(tiny[0])
    a, b, c = (make_request(list(range(1, 40)), max_tokens=20) for _ in range(3))
    for r in (a, b, c):
        core.add_request(r)
    core.abort_requests([c.request_id])  # waiting
    core.step()
    core.step()
    core.abort_requests([a.request_id, "unknown-id"])  # running
    while core.has_unfinished_requests():
        core.step()
    assert b.num_output_tokens == 20
    assert a.get_finish_reason() == c.get_finish_reason() == "abort"
    assert_idle(core)


def test_layout_and_stats(tiny) -> None:
    core = make_core(tiny[0], num_blocks=16)
    layout = core.layout
    assert layout == KVCacheLayout("tiny-llama", 2, 2, 8, "float32", BLOCK)
    assert layout.block_bytes == core.executor.driver_worker.kv_cache[0].numel() * 4
    assert layout.block_shape == tuple(core.executor.driver_worker.kv_cache.shape[1:])
    assert len(layout.fingerprint) == 16
    other = KVCacheLayout("tiny-llama", 2, 2, 8, "float32", BLOCK * 2)
    assert other.fingerprint != layout.fingerprint
    stats = core.get_stats()
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_running) == (16, 16, 0)


def test_memory_connector_producer_to_consumer(tiny) -> None:
    """A prefill engine publishes KV; a decode engine loads it and continues exactly."""
    loaded, hf = tiny
    store = MemoryKVStore()
    name = register_memory_connector(store)
    producer = make_core(loaded, kv_connector=name, kv_role="kv_producer")
    consumer = make_core(loaded, kv_connector=name, kv_role="kv_consumer")
    prompt = list(range(30, 52))  # 22 tokens: 5 full blocks and a partial one
    run(producer, make_request(prompt, max_tokens=1))
    assert len(store) == 6
    assert_idle(producer)

    req = make_request(prompt, max_tokens=8)
    outs = run(consumer, req)[req.request_id]
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(hf, prompt, 8)
    assert outs[0].num_cached_tokens >= 20  # loaded, not recomputed
    assert_idle(consumer)


def test_llm_engine_children_come_from_fan_out(tiny) -> None:
    """Bug pinned: the offline engine named children ``{i}_{rid}`` while the router used
    ``{rid}-{i}``; both now take ids and seeds from ``engine.fan_out.fan_out``."""
    from tandem.engine.fan_out import fan_out
    from tandem.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_core=make_core(tiny[0]))
    params = SamplingParams(n=3, seed=7, max_tokens=2, temperature=0.8)
    parent, requests = engine.make_requests("p", [1, 2, 3], params)
    want = fan_out("p", params)
    assert [r.request_id for r in requests] == [c.request_id for c in want]
    assert [r.sampling_params for r in requests] == [c.sampling_params for c in want]
    assert [c.index for c in parent.children] == [0, 1, 2]
