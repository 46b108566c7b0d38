"""EngineCore on a tiny random Llama: validation, the step loop, layout, KV connector."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers

from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from tandem.engine.engine_core import EngineCore, KVCacheLayout
from tandem.engine.kv_connector import MemoryKVStore
from tandem.engine.model_loader import LoadedModel
from tandem.engine.models.registry import build_model
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

VOCAB = 97
MAX_LEN = 64
BLOCK = 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, transformers.PreTrainedModel]:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        architectures=["LlamaForCausalLM"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    model = build_model(config, hf.state_dict(), torch.float32, "cpu", MAX_LEN)
    loaded = LoadedModel(
        model=model,
        hf_config=config,
        tokenizer=None,
        model_id="tiny-llama",
        dtype=torch.float32,
        device=torch.device("cpu"),
        eos_token_id=None,
        max_position=MAX_LEN,
    )
    return loaded, hf


def make_core(loaded: LoadedModel, num_blocks: int = 32, **kv: object) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        kv_transfer=KVTransferConfig(**kv) if kv else KVTransferConfig(),
    )
    return EngineCore(config, loaded)


def make_request(prompt: list[int], **params: object) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(f"r{next(_ids)}", prompt, SamplingParams(**params))


def run(core: EngineCore, *reqs: Request) -> dict[str, list]:
    """Add requests, step to the end; request id -> its EngineCoreOutputs."""
    for r in reqs:
        core.add_request(r)
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    while core.has_unfinished_requests():
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def assert_idle(core: EngineCore) -> None:
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.has_unfinished_requests()


def hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


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
    assert layout.block_size_bytes == core.model_runner.kv_cache[0].numel() * 4
    assert len(layout.fingerprint) == 16
    other = KVCacheLayout("tiny-llama", 2, 2, 8, "float32", BLOCK * 2)
    assert other.fingerprint != layout.fingerprint
    stats = core.get_stats()
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.num_running) == (16, 16, 0)


def test_memory_connector_producer_to_consumer(tiny) -> None:
    """A prefill engine publishes KV; a decode engine loads it and continues exactly."""
    loaded, hf = tiny
    store = MemoryKVStore()
    producer = make_core(
        loaded, kv_connector="memory", kv_role="kv_producer", params={"store": store}
    )
    consumer = make_core(
        loaded, kv_connector="memory", kv_role="kv_consumer", params={"store": store}
    )
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
