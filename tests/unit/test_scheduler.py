"""Scheduler: budget, mixed batches, chunking, preemption, priority, limits, stops,
aborts at every stage, and the remote-KV path with the in-process memory connector.

The scheduler is pure: a fake model runner built here plays the forward pass. It
writes a value per KV slot that depends on the whole prefix (like real K/V), and
checks before every step that the slots of already-computed tokens hold the right
values, so prefix-cache hits, remote loads and recompute after preemption are
checked for content, not only for counts.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from memory_connector import MemoryConnectorScheduler, MemoryKVStore, register_memory_connector

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import CacheConfig, KVConnectorConfig, KVTransferConfig, SchedulerConfig
from tandem.engine.kv_connector import create_connector, register_connector, unregister_connector
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Logprob, Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.scheduler import Scheduler

BS = 16
_bases = itertools.count(1000, 1000)


# -- factories ------------------------------------------------------------------------------


def make_scheduler(
    num_blocks: int = 10,
    block_size: int = BS,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    chunked: bool = True,
    max_model_len: int = 4096,
    caching: bool = True,
    connector=None,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=policy,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        connector=connector,
    )


def make_request(
    request_id: str,
    num_tokens: int | None = None,
    token_ids: list[int] | None = None,
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    **params,
) -> Request:
    """A request with ``token_ids`` or ``num_tokens`` tokens unique to it."""
    if token_ids is None:
        assert num_tokens is not None
        base = next(_bases)
        token_ids = list(range(base, base + num_tokens))
    kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(
        request_id,
        token_ids,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        priority=priority,
        **kwargs,
    )


def kv_value(prev: float, token: int) -> float:
    """KV of a position: depends on the token and on the whole prefix before it."""
    return float((int(prev) * 1000003 + token + 1) % (1 << 40))


class FakeRunner:
    """Plays the model runner against a KV tensor ``[num_blocks, 1, 2, bs, 1, 1]`` (float64).

    Each step it (1) checks every computed slot of each scheduled request holds the
    expected prefix-dependent value, (2) writes the new tokens' values, (3) samples
    ``script[rid]``'s next token (default 5) for requests at the end of their tokens.
    """

    def __init__(self, num_blocks: int, block_size: int = BS, script=None) -> None:
        self.bs = block_size
        self.kv = torch.zeros(num_blocks, 1, 2, block_size, 1, 1, dtype=torch.float64)
        self.script = {k: iter(v) for k, v in (script or {}).items()}
        self.logprobs: dict[str, dict[int, Logprob]] = {}

    def expected(self, req: Request, upto: int) -> list[float]:
        vals, prev = [], 0.0
        for tok in req.all_token_ids[:upto]:
            prev = kv_value(prev, tok)
            vals.append(prev)
        return vals

    def slot_value(self, table: list[int], pos: int) -> float:
        return float(self.kv[table[pos // self.bs], 0, 0, pos % self.bs, 0, 0])

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, int] = {}
        for req in so.scheduled_requests:
            rid, n = req.request_id, so.num_scheduled_tokens[req.request_id]
            table, start = so.block_tables[rid], req.num_computed_tokens
            assert n >= 1 and start + n <= req.num_tokens, f"{rid}: beyond known tokens"
            assert len(table) * self.bs >= start + n, f"{rid}: table too short"
            exp = self.expected(req, start + n)
            for pos in range(start):
                assert self.slot_value(table, pos) == exp[pos], f"{rid}: stale KV at {pos}"
            for pos in range(start, start + n):
                self.kv[table[pos // self.bs], 0, :, pos % self.bs] = exp[pos]
            if start + n == req.num_tokens:
                it = self.script.get(rid)
                sampled[rid] = next(it, 5) if it is not None else 5
        lps = {rid: lp for rid, lp in self.logprobs.items() if rid in sampled}
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=lps)


def step(sched: Scheduler, runner: FakeRunner, worker=None):
    """One engine step as EngineCore runs it (connector worker calls included)."""
    so = sched.schedule()
    meta = so.kv_connector_metadata
    if worker is not None:
        worker.start_load_kv(meta)
    out = runner(so) if not so.is_empty else ModelRunnerOutput()
    sending, recving = set(), {}
    if worker is not None:
        worker.save_kv(meta)
        sending, recving = worker.get_finished()
    return so, sched.update_from_output(so, out, recving, sending)


def run_to_completion(sched, runner, worker=None, max_steps=500) -> dict[str, EngineCoreOutput]:
    finals: dict[str, EngineCoreOutput] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finals
        _, outs = step(sched, runner, worker)
        finals.update({o.request_id: o for o in outs if o.finished})
    raise AssertionError("did not finish")


def assert_pool_full(sched: Scheduler) -> None:
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.kv_cache_manager.req_to_blocks == {}


def check_invariants(sched: Scheduler, so: SchedulerOutput) -> None:
    cfg = sched.config
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    counts = [0] * pool.num_blocks
    for table in kvm.req_to_blocks.values():
        for b in table:
            counts[b.block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == counts, "ref counts != table membership"
    free = {b.block_id for b in pool.free_block_queue.get_all_free_blocks()}
    assert free == {i for i, c in enumerate(counts) if c == 0}
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h


# -- budget, batches, chunking -------------------------------------------------------------


def test_token_budget_is_shared_in_fcfs_order_and_the_tail_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=25)
    reqs = [make_request(r, 10) for r in "abc"]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(10)
    so, outs = step(sched, runner)
    assert [r.request_id for r in so.scheduled_requests] == ["a", "b", "c"]
    assert so.num_scheduled_tokens == {"a": 10, "b": 10, "c": 5}
    assert so.total_num_scheduled_tokens == 25
    assert [o.request_id for o in outs] == ["a", "b"]  # c's chunk samples nothing
    assert [r.num_computed_tokens for r in reqs] == [10, 10, 5]
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 5}
    assert [o.request_id for o in outs] == ["a", "b", "c"]


def test_mixed_batch_puts_decodes_first_then_new_prefills() -> None:
    sched = make_scheduler()
    runner = FakeRunner(10)
    sched.add_request(make_request("a", 20))
    step(sched, runner)
    sched.add_request(make_request("b", 30))
    so, outs = step(sched, runner)
    assert [r.request_id for r in so.scheduled_requests] == ["a", "b"]
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}
    assert so.block_tables == {"a": [0, 1], "b": [2, 3]}
    assert [o.new_token_ids for o in outs] == [[5], [5]]


def test_decodes_are_served_before_a_running_chunked_prefill() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(10)
    sched.add_request(make_request("a", 10))
    step(sched, runner)  # a: prefill 10
    sched.add_request(make_request("long", 40))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "long": 15}
    sched.add_request(make_request("c", 4))
    so, _ = step(sched, runner)  # running order is [a, long]; a's decode goes first
    assert [r.request_id for r in so.scheduled_requests] == ["a", "long"]
    assert so.num_scheduled_tokens == {"a": 1, "long": 15}


def test_chunked_prefill_progresses_and_samples_only_at_the_last_chunk() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(10)
    req = make_request("a", 40)
    sched.add_request(req)
    seen = []
    for _ in range(3):
        so, outs = step(sched, runner)
        seen.append((so.num_scheduled_tokens["a"], req.num_computed_tokens, len(outs)))
        assert so.block_tables["a"] == list(range(len(so.block_tables["a"])))
    assert seen == [(16, 16, 0), (16, 32, 0), (8, 40, 1)]
    assert req.num_tokens == 41 and req.output_token_ids == [5]


def test_long_prefill_threshold_caps_each_prompt_per_step() -> None:
    """A long prompt advances 12 tokens a step; the short prompt that arrives behind
    it gets into the same step instead of waiting for the long one's prefill."""
    sched = make_scheduler(
        num_blocks=20, max_num_batched_tokens=64, long_prefill_token_threshold=12
    )
    runner = FakeRunner(20)
    long_req = make_request("long", 50)
    sched.add_request(long_req)
    sched.add_request(make_request("short", 8))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"long": 12, "short": 8}
    assert [o.request_id for o in outs] == ["short"]
    seen = []
    while long_req.num_computed_tokens < 50:
        so, _ = step(sched, runner)
        seen.append(so.num_scheduled_tokens)
    assert seen == [{"short": 1, "long": 12}] * 3 + [{"short": 1, "long": 2}]
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"short": 1, "long": 1}


def test_long_prefill_threshold_is_validated() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_chunking_off_prompt_waits_for_a_step_where_it_fits() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, chunked=False)
    runner = FakeRunner(10)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 20}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20}


def test_chunking_off_rejects_a_prompt_longer_than_the_step_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, chunked=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add_request(make_request("a", 33))
    assert not sched.has_unfinished_requests()


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(10)
    for r in "abc":
        sched.add_request(make_request(r, 4, max_tokens=2))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    so, outs = step(sched, runner)  # a and b finish (2 tokens)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["c"]
    assert so.finished_req_ids == {"a", "b"}


def test_n_siblings_in_one_step_share_the_prompt_blocks() -> None:
    sched = make_scheduler()
    runner = FakeRunner(10)
    prompt = list(range(40))
    sched.add_request(make_request("s0", token_ids=prompt))
    sched.add_request(make_request("s1", token_ids=prompt))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"s0": 40, "s1": 8}
    assert so.block_tables == {"s0": [0, 1, 2], "s1": [0, 1, 3]}
    assert sched.requests["s1"].num_cached_tokens == 32
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def test_prefix_cache_reuses_a_finished_requests_blocks() -> None:
    sched = make_scheduler()
    runner = FakeRunner(10)
    prompt = list(range(50))
    sched.add_request(make_request("a", token_ids=prompt, max_tokens=1))
    run_to_completion(sched, runner)
    b = make_request("b", token_ids=prompt + [7, 8], max_tokens=1)
    sched.add_request(b)
    so, outs = step(sched, runner)  # the runner checks the reused KV content
    assert so.num_scheduled_tokens == {"b": 4}
    assert outs[0].num_cached_tokens == 48
    run_to_completion(sched, runner)
    assert_pool_full(sched)


# -- preemption and priority ---------------------------------------------------------------


def test_preemption_fcfs_evicts_the_latest_arrival_and_resumes_it() -> None:
    sched = make_scheduler(num_blocks=4)
    runner = FakeRunner(4)
    a = make_request("a", 31, max_tokens=3, arrival_time=1.0)
    b = make_request("b", 31, max_tokens=5, arrival_time=2.0)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # both prefilled: tables [0, 1] and [2, 3]
    step(sched, runner)  # position 31 still fits
    so, outs = step(sched, runner)  # a needs a 3rd block: b is preempted
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.block_tables == {"a": [0, 1, 3]}  # b's blocks went back tail-first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    assert sched.get_stats().num_preemptions == 1 and b.num_preemptions == 1
    assert outs[0].finish_reason == "length"  # a is done
    so, _ = step(sched, runner)  # b resumes: its first block is still cached
    assert so.num_scheduled_tokens == {"b": 33 - 16}
    assert so.block_tables == {"b": [2, 3, 1]}
    finals = run_to_completion(sched, runner)
    assert finals["b"].finish_reason == "length" and b.num_output_tokens == 5
    assert_pool_full(sched)


def test_preemption_priority_victim_is_highest_priority_value_even_if_already_scheduled() -> None:
    sched = make_scheduler(num_blocks=4, policy="priority")
    runner = FakeRunner(4)
    a = make_request("a", 31, max_tokens=10, priority=5, arrival_time=1.0)
    sched.add_request(a)
    step(sched, runner)  # a: blocks [0, 1]
    b = make_request("b", 16, max_tokens=10, priority=0, arrival_time=2.0)
    sched.add_request(b)
    step(sched, runner)  # a decodes, b prefills into block 2
    so, _ = step(sched, runner)
    # a took the last free block first, then b needed one: a (priority 5) loses
    # although it arrived first, and its slot in this batch is refunded.
    assert so.preempted_req_ids == {"a"}
    assert [r.request_id for r in so.scheduled_requests] == ["b"]
    assert so.total_num_scheduled_tokens == 1
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    run_to_completion(sched, runner)
    assert a.num_output_tokens == 10 and b.num_output_tokens == 10
    assert_pool_full(sched)


def test_priority_policy_admits_lowest_value_then_earliest_arrival() -> None:
    sched = make_scheduler(policy="priority", max_num_batched_tokens=16)
    runner = FakeRunner(10)
    sched.add_request(make_request("c", 16, max_tokens=1, priority=1, arrival_time=1.0))
    sched.add_request(make_request("a", 16, max_tokens=1, priority=0, arrival_time=3.0))
    sched.add_request(make_request("b", 16, max_tokens=1, priority=0, arrival_time=2.0))
    order = [next(iter(step(sched, runner)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["b", "a", "c"]


def test_fcfs_ignores_priority() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(10)
    sched.add_request(make_request("first", 16, max_tokens=1, priority=9))
    sched.add_request(make_request("second", 16, max_tokens=1, priority=0))
    order = [next(iter(step(sched, runner)[0].num_scheduled_tokens)) for _ in range(2)]
    assert order == ["first", "second"]


# -- limits and stop conditions ------------------------------------------------------------


def assert_length_cap(sched: Scheduler, runner: FakeRunner, cap: int, match: str,
                      prompt_len: int, max_tokens: int) -> None:
    """A prompt of ``cap + 1`` tokens is refused at admission (ValueError matching
    ``match``); one of ``prompt_len`` tokens asking for ``max_tokens`` more stops with
    "length" at exactly ``cap`` tokens."""
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("long", cap + 1))
    req = make_request("a", prompt_len, max_tokens=max_tokens)
    sched.add_request(req)
    finals = run_to_completion(sched, runner)
    assert finals["a"].finish_reason == "length" and req.num_tokens == cap


def test_max_model_len_at_admission_and_as_a_length_stop() -> None:
    sched = make_scheduler(max_model_len=20)
    assert_length_cap(sched, FakeRunner(10), 20, "max_model_len", prompt_len=18, max_tokens=100)


def test_kv_capacity_caps_the_sequence_length() -> None:
    sched = make_scheduler(num_blocks=2)  # 32 tokens of KV
    assert_length_cap(sched, FakeRunner(2), 32, "KV cache", prompt_len=30, max_tokens=10)
    assert_pool_full(sched)


@pytest.mark.parametrize(
    ("params", "script", "tokens", "reason", "stop_reason"),
    [
        ({}, [5, 2, 5], [5, 2], "stop", None),
        ({"ignore_eos": True, "max_tokens": 4}, [2, 2, 2, 2, 2], [2, 2, 2, 2], "length", None),
        ({"min_tokens": 2}, [2, 2, 2, 5], [2, 2, 2], "stop", None),
        ({"stop_token_ids": [9]}, [5, 9, 5], [5, 9], "stop", 9),
        ({"stop_token_ids": [9], "min_tokens": 1}, [9, 9], [9, 9], "stop", 9),
        ({"max_tokens": 1}, [5], [5], "length", None),
    ],
)
def test_stop_conditions(params, script, tokens, reason, stop_reason) -> None:
    sched = make_scheduler()
    req = make_request("a", 8, eos_token_id=2, **({"max_tokens": 16} | params))
    sched.add_request(req)
    finals = run_to_completion(sched, FakeRunner(10, script={"a": script}))
    assert req.output_token_ids == tokens
    assert finals["a"].finish_reason == reason and finals["a"].stop_reason == stop_reason
    assert_pool_full(sched)


def test_outputs_carry_logprobs_and_finished_ids_reach_the_next_step() -> None:
    sched = make_scheduler()
    runner = FakeRunner(10)
    lp = {5: Logprob(-0.25, rank=1), 6: Logprob(-1.5, rank=2)}
    runner.logprobs["a"] = lp
    req = make_request("a", 8, max_tokens=1, logprobs=1)
    sched.add_request(req)
    so, outs = step(sched, runner)
    assert outs == [EngineCoreOutput("a", [5], [lp], finish_reason="length", num_cached_tokens=0)]
    assert req.output_logprobs == [lp]
    assert sched.schedule().finished_req_ids == {"a"}


def test_finish_requests_from_the_frontend_frees_blocks() -> None:
    sched = make_scheduler()
    runner = FakeRunner(10)
    req = make_request("a", 20)
    sched.add_request(req)
    step(sched, runner)
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert req.get_finish_reason() == "stop"
    assert not sched.has_unfinished_requests()
    assert_pool_full(sched)


def test_bad_requests_are_rejected_with_the_field_named() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add_request(make_request("empty", token_ids=[]))


# -- aborts ---------------------------------------------------------------------------------


def _abort_waiting(sched, runner):
    req = make_request("x", 40)
    sched.add_request(req)
    sched.abort_requests(["x"])
    return req


def _abort_mid_prefill(sched, runner):
    req = make_request("x", 40)
    sched.add_request(req)
    step(sched, runner)
    assert req.num_computed_tokens == 16 and req.status == RequestStatus.RUNNING
    sched.abort_requests(["x"])
    return req


def _abort_decoding(sched, runner):
    req = make_request("x", 20, max_tokens=50)
    sched.add_request(req)
    for _ in range(3):
        step(sched, runner)
    assert req.num_output_tokens == 2
    sched.abort_requests(["x"])
    return req


def _abort_mid_step(sched, runner):
    req = make_request("x", 20)
    sched.add_request(req)
    so = sched.schedule()  # the step is scheduled, then the client goes away
    sched.abort_requests(["x"])
    assert sched.update_from_output(so, runner(so)) == []
    return req


def _abort_preempted(sched, runner):
    old = make_request("old", 31, max_tokens=20, arrival_time=1.0)
    req = make_request("x", 31, max_tokens=20, arrival_time=2.0)
    sched.add_request(old)
    sched.add_request(req)
    for _ in range(3):
        step(sched, runner)
    assert req.status == RequestStatus.PREEMPTED
    sched.abort_requests(["old", "x"])
    return req


@pytest.mark.parametrize(
    ("stage", "num_blocks", "budget"),
    [
        (_abort_waiting, 10, 16),
        (_abort_mid_prefill, 10, 16),
        (_abort_decoding, 10, 16),
        (_abort_mid_step, 10, 16),
        (_abort_preempted, 4, 64),
    ],
)
def test_abort_at_each_stage_returns_the_pool_to_full(stage, num_blocks, budget) -> None:
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget)
    runner = FakeRunner(num_blocks)
    req = stage(sched, runner)
    assert req.status == RequestStatus.FINISHED_ABORTED and req.get_finish_reason() == "abort"
    assert not sched.has_unfinished_requests()
    assert len(sched.waiting) == 0 and sched.running == []
    assert_pool_full(sched)
    sched.abort_requests([req.request_id, "never-existed"])  # ignored
    assert "x" in sched.schedule().finished_req_ids


# -- remote KV through the memory connector ------------------------------------------------


#: The layout of FakeRunner's cache (one layer, one head of size 1).
LAYOUT = KVCacheLayout("fake", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32",
                       block_size=BS)


def make_pd(num_blocks: int = 10, store: MemoryKVStore | None = None, role: str = "kv_producer"):
    name = register_memory_connector(store if store is not None else MemoryKVStore())
    pair = create_connector(KVTransferConfig(kv_connector=name, kv_role=role), LAYOUT)
    assert pair is not None
    conn, worker = pair
    sched = make_scheduler(num_blocks=num_blocks, connector=conn)
    runner = FakeRunner(num_blocks)
    worker.register_kv_caches(runner.kv)
    return sched, runner, worker


PROMPT = list(range(300, 340))  # 40 tokens: 2 full blocks + 8


def prefill_into(store: MemoryKVStore, prompt: list[int] = PROMPT) -> int:
    """Run ``prompt`` through a producer engine; return the first token."""
    sched, runner, worker = make_pd(store=store, role="kv_producer")
    sched.add_request(make_request("p", token_ids=prompt, max_tokens=1))
    so, outs = step(sched, runner, worker)
    # Finished, but its blocks stay until the save is reported.
    assert outs[0].finish_reason == "length"
    assert sched.get_stats().num_pending_kv_sends == 1
    assert sched.has_unfinished_requests()
    num_blocks = -(-len(prompt) // BS)
    assert sched.kv_cache_manager.num_free_blocks == 10 - num_blocks
    step(sched, runner, worker)  # the save runs and is reported
    assert not sched.has_unfinished_requests()
    assert_pool_full(sched)
    assert len(store) == num_blocks  # full blocks and the partial tail
    return outs[0].new_token_ids[0]


def decode_request(first_token: int) -> Request:
    req = make_request("d", token_ids=PROMPT, max_tokens=4)
    req.append_output_token(first_token)
    return req


def prefilled_consumer(prompt: list[int] = PROMPT, num_blocks: int = 10):
    """A store that a producer prefilled with ``prompt``, and a consumer engine on it:
    (store, first token, scheduler, runner, worker)."""
    store = MemoryKVStore()
    first = prefill_into(store, prompt)
    return (store, first, *make_pd(num_blocks=num_blocks, store=store, role="kv_consumer"))


def test_remote_kv_load_then_decode() -> None:
    _store, first, sched, runner, worker = prefilled_consumer()
    req = decode_request(first)
    sched.add_request(req)
    so, outs = step(sched, runner, worker)
    assert so.is_empty and outs == []
    loads = so.kv_connector_metadata.loads
    assert loads["d"].block_ids == [0, 1, 2] and loads["d"].num_tokens == [16, 16, 8]
    assert req.status == RequestStatus.WAITING  # the load was reported this step
    assert sched.get_stats().num_waiting_for_remote_kv == 0
    so, outs = step(sched, runner, worker)  # the runner checks the loaded KV
    assert so.num_scheduled_tokens == {"d": 1}
    assert outs[0].num_cached_tokens == 40 and req.num_computed_tokens == 41
    finals = run_to_completion(sched, runner, worker)
    assert finals["d"].finish_reason == "length" and req.num_output_tokens == 4
    assert sched.get_stats().num_kv_load_failures == 0
    assert_pool_full(sched)


def test_request_waits_in_remote_kv_state_until_the_load_is_reported() -> None:
    _store, first, sched, runner, _worker = prefilled_consumer()
    req = decode_request(first)
    sched.add_request(req)
    sched.add_request(make_request("other", 8, max_tokens=3))
    so = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert so.num_scheduled_tokens == {"other": 8}  # the load does not block others
    assert sched.get_stats().num_waiting_for_remote_kv == 1
    sched.update_from_output(so, runner(so))
    # No report yet: still waiting, holding its 3 blocks.
    so = sched.schedule()
    assert "d" not in so.num_scheduled_tokens
    assert sched.kv_cache_manager.get_block_ids("d") == [0, 1, 2]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    # The load "arrived" (we write the KV as the worker would have).
    for pos, val in enumerate(runner.expected(req, 40)):
        runner.kv[pos // BS, 0, :, pos % BS] = val
    sched.update_from_output(so, runner(so), finished_recving={"d": 40})
    assert req.status == RequestStatus.WAITING
    so = sched.schedule()
    assert so.num_scheduled_tokens["d"] == 1 and req.num_computed_tokens == 40


def test_remote_load_allocates_blocks_for_every_token_up_front() -> None:
    """A loaded request must not need one more block to run: while it waits it holds
    blocks and cannot be preempted, so a full pool of such requests would deadlock."""
    prompt = list(range(500, 532))  # 32 tokens: the first token starts block 2
    _store, first, sched, runner, worker = prefilled_consumer(prompt, num_blocks=3)
    req = make_request("d", token_ids=prompt, max_tokens=2)
    req.append_output_token(first)
    sched.add_request(req)
    so, _ = step(sched, runner, worker)
    assert so.kv_connector_metadata.loads["d"].block_ids == [0, 1]
    assert sched.kv_cache_manager.get_block_ids("d") == [0, 1, 2]
    assert sched.kv_cache_manager.num_free_blocks == 0
    so, outs = step(sched, runner, worker)
    assert so.num_scheduled_tokens == {"d": 1} and outs[0].num_cached_tokens == 32
    run_to_completion(sched, runner, worker)
    assert_pool_full(sched)


def test_short_remote_load_recomputes_the_rest() -> None:
    store, first, sched, runner, worker = prefilled_consumer()
    req = decode_request(first)
    sched.add_request(req)
    so = sched.schedule()
    # The second block disappears between the lookup and the load: a real miss.
    assert store.evict(so.kv_connector_metadata.loads["d"].block_hashes[1])
    worker.start_load_kv(so.kv_connector_metadata)
    sending, recving = worker.get_finished()
    assert recving == {"d": 16}
    sched.update_from_output(so, ModelRunnerOutput(), recving, sending)
    so, outs = step(sched, runner, worker)
    assert so.num_scheduled_tokens == {"d": 41 - 16}
    assert outs[0].num_cached_tokens == 16
    assert sched.get_stats().num_kv_load_failures == 1
    run_to_completion(sched, runner, worker)
    assert_pool_full(sched)


def test_local_prefix_hit_plus_remote_load_for_the_rest() -> None:
    _store, first, sched, runner, worker = prefilled_consumer()
    # A local request shares the first block of PROMPT.
    sched.add_request(make_request("local", token_ids=PROMPT[:20], max_tokens=1))
    run_to_completion(sched, runner, worker)
    req = decode_request(first)
    sched.add_request(req)
    so, _ = step(sched, runner, worker)
    load = so.kv_connector_metadata.loads["d"]
    assert load.num_tokens == [16, 8]  # only blocks 1 and 2 come from the store
    assert load.block_ids == sched.kv_cache_manager.get_block_ids("d")[1:]
    so, outs = step(sched, runner, worker)
    assert so.num_scheduled_tokens == {"d": 1} and outs[0].num_cached_tokens == 40
    assert sched.get_stats().prefix_cache_hits == 16
    run_to_completion(sched, runner, worker)
    assert_pool_full(sched)


def test_abort_while_waiting_for_remote_kv_frees_blocks() -> None:
    _store, first, sched, runner, _ = prefilled_consumer()
    sched.add_request(decode_request(first))
    so = sched.schedule()
    assert sched.kv_cache_manager.num_free_blocks == 7
    sched.abort_requests(["d"])
    assert_pool_full(sched)
    # A late report for the aborted request is ignored.
    sched.update_from_output(so, ModelRunnerOutput(), finished_recving={"d": 40})
    assert not sched.has_unfinished_requests()


class _InFlightLoadConnector(MemoryConnectorScheduler):
    """Behaves like a connector whose loads run asynchronously: an aborted request's
    blocks may still be written, so it asks the scheduler to keep them."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        if request.status == RequestStatus.FINISHED_ABORTED:
            return True
        return super().request_finished(request, block_ids)


def test_abort_with_an_in_flight_load_frees_when_the_worker_lets_go() -> None:
    store = MemoryKVStore()
    first = prefill_into(store)
    sched = make_scheduler(connector=_InFlightLoadConnector(store, BS, "kv_consumer"))
    sched.add_request(decode_request(first))
    so = sched.schedule()
    sched.abort_requests(["d"])
    assert sched.kv_cache_manager.num_free_blocks == 7  # still held
    assert sched.has_unfinished_requests()
    sched.update_from_output(so, ModelRunnerOutput(), finished_recving={"d": 12})
    assert not sched.has_unfinished_requests()
    assert_pool_full(sched)


def test_connector_registry() -> None:
    assert create_connector(KVTransferConfig(), LAYOUT) is None
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        create_connector(KVTransferConfig(kv_connector="nope"), LAYOUT)
    with pytest.raises(ValueError, match="module:function"):
        register_connector("bad", "no_colon")
    # A "module:function" target is imported only when chosen.
    register_connector("by-name", "memory_connector:no_such_factory")
    try:
        with pytest.raises(AttributeError, match="no_such_factory"):
            create_connector(KVTransferConfig(kv_connector="by-name"), LAYOUT)
    finally:
        unregister_connector("by-name")
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        create_connector(KVTransferConfig(kv_connector="by-name"), LAYOUT)


def test_kv_transfer_config_rejects_an_untyped_connector_config() -> None:
    """Regression: connector settings were an untyped dict that could carry anything
    (test callables included); only a KVConnectorConfig is accepted now."""
    with pytest.raises(ValueError, match="connector_config must be a KVConnectorConfig"):
        KVTransferConfig(kv_connector="store", connector_config={"redis_url": "x"})  # type: ignore[arg-type]
    assert KVTransferConfig(connector_config=KVConnectorConfig()).connector_config is not None


def test_memory_worker_rejects_a_wrongly_shaped_kv_cache() -> None:
    name = register_memory_connector(MemoryKVStore())
    _conn, worker = create_connector(KVTransferConfig(kv_connector=name), LAYOUT)
    with pytest.raises(ValueError, match="num_layers, 2"):
        worker.register_kv_caches(torch.zeros(4, 2, BS, 1, 1))


# -- stats and a randomized workload -------------------------------------------------------


def test_get_stats_snapshot() -> None:
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(10)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20))
    step(sched, runner)
    s = sched.get_stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks) == (2, 0, 6, 10)
    assert s.kv_cache_usage == pytest.approx(0.4)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions) == (40, 0, 0)


@pytest.mark.parametrize(
    ("policy", "chunked", "caching", "num_blocks"),
    [
        ("fcfs", True, True, 12),
        ("fcfs", False, True, 12),
        ("priority", True, True, 9),
        ("fcfs", True, False, 9),
    ],
)
def test_random_workload_keeps_invariants_and_kv_content(policy, chunked, caching, num_blocks):
    """Shared prefixes, a tiny cache (preemptions), random aborts: after every step
    ref counts match the tables, the budget holds, the runner finds correct KV in
    every computed slot, and at the end the pool is full."""
    rng = random.Random(1234)
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        policy=policy,
        chunked=chunked,
        caching=caching,
    )
    script = {}
    runner = FakeRunner(num_blocks, script=script)
    prefixes = [list(range(k * 100, k * 100 + 40)) for k in range(3)]
    num_added = 0
    for t in range(400):
        if num_added < 30 and rng.random() < 0.3:
            rid = f"r{num_added}"
            prompt = rng.choice(prefixes)[: rng.randint(1, 40)] + [
                rng.randint(0, 50) for _ in range(rng.randint(0, 8))
            ]
            script[rid] = [rng.randint(0, 50) for _ in range(64)]
            runner.script[rid] = iter(script[rid])
            sched.add_request(
                make_request(
                    rid,
                    token_ids=prompt,
                    max_tokens=rng.randint(1, 30),
                    priority=rng.randint(0, 3),
                    arrival_time=float(t),
                    eos_token_id=0,
                )
            )
            num_added += 1
        if sched.requests and rng.random() < 0.05:
            sched.abort_requests([rng.choice(list(sched.requests))])
        so, _ = step(sched, runner)
        check_invariants(sched, so)
        if num_added == 30 and not sched.has_unfinished_requests():
            break
    assert num_added == 30 and not sched.has_unfinished_requests()
    if num_blocks == 9:
        assert sched.get_stats().num_preemptions > 0
    if caching:
        assert sched.get_stats().prefix_cache_hits > 0
    assert_pool_full(sched)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_request_queues_order_prepend_and_remove(policy) -> None:
    from tandem.engine.request_queue import create_request_queue

    q = create_request_queue(policy)
    a = make_request("a", 1, priority=1, arrival_time=1.0)
    b = make_request("b", 1, priority=0, arrival_time=2.0)
    c = make_request("c", 1, priority=0, arrival_time=3.0)
    for r in (a, b, c):
        q.add(r)
    expected = ["a", "b", "c"] if policy == "fcfs" else ["b", "c", "a"]
    assert [r.request_id for r in q] == expected
    head = q.pop()
    q.prepend([head])  # a preempted / skipped request goes back in front
    assert [r.request_id for r in q] == expected
    q.remove_many([b])
    assert [r.request_id for r in q] == [x for x in expected if x != "b"]
    assert len(q) == 2 and q.peek().request_id == expected[0 if expected[0] != "b" else 1]
    with pytest.raises(ValueError, match="policy"):
        create_request_queue("lifo")


@pytest.mark.parametrize(
    ("params", "first_token", "max_model_len"),
    [
        ({}, 2, 4096),
        ({}, 5, 4096),
        ({"ignore_eos": True}, 2, 4096),
        ({"min_tokens": 1}, 2, 4096),
        ({"stop_token_ids": [9]}, 9, 4096),
        ({"stop_token_ids": [2], "ignore_eos": True}, 2, 4096),
        ({"max_tokens": 1}, 5, 4096),
        ({"max_tokens": 1}, 2, 4096),
        ({}, 5, 9),  # prompt of 8 + token 1 fills the context
    ],
)
def test_first_token_stop_matches_what_services_decide(params, first_token, max_model_len):
    """Bug pinned: the services decided "does output token 1 finish the request" with a
    copy of the scheduler's rule (``first_token_finish_reason``); both now call
    ``engine.stop.check_stop``, and the scheduler's outcome must equal its answer."""
    from tandem.engine.stop import check_stop

    sched = make_scheduler(max_model_len=max_model_len)
    req = make_request("a", 8, eos_token_id=2, **({"max_tokens": 16} | params))
    # What a service sees: the prompt plus output token 1, outside any scheduler.
    alone = make_request("b", token_ids=list(req.prompt_token_ids), eos_token_id=2,
                         **({"max_tokens": 16} | params))
    alone.append_output_token(first_token)
    expected = check_stop(alone, sched.max_seq_len)
    sched.add_request(req)
    _, outs = step(sched, FakeRunner(10, script={"a": [first_token]}))
    assert outs[0].new_token_ids == [first_token]
    assert outs[0].finish_reason == (None if expected is None else expected.finish_reason)
    assert outs[0].stop_reason == (None if expected is None else expected.stop_reason)


def test_finished_ids_wait_for_a_step_that_runs() -> None:
    """A step with nothing scheduled never reaches the executor, so the ids finished
    before it must come with the next step that runs (the workers and the proposer drop
    per-request state by them); they were lost before."""
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=1))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids={"a": 1}))
    empty = sched.schedule()
    assert empty.is_empty and empty.finished_req_ids == {"a"}
    sched.add_request(make_request("b", 4))
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()
