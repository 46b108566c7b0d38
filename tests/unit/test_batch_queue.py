"""The batch queue (vLLM v1's ``step_with_batch_queue``): EngineCore keeps up to
``max_concurrent_batches`` batches in flight through a fake pipelined executor that
checks, at every submit, the rules the workers rely on: no request in two batches in
flight, no request of a batch in flight preempted, no block of a batch in flight
free (so nothing can hand it to another request while the workers still write it).
The real two-stage pipeline against transformers is in tests/e2e/test_llm_parallel.py.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from test_executor import FakeExecutor, make_config, make_facts

from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput


class PipelinedFake(FakeExecutor):
    """Two steps in flight; samples token ``(request index * 7 + output count) % 40 + 8``
    (never the EOS 7), so a request's tokens do not depend on how it was batched."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core: EngineCore | None = None
        self.in_flight: list[SchedulerOutput] = []
        #: Submits of an all-decode batch while another all-decode batch was in flight.
        self.overlapped_decodes = 0

    @property
    def max_concurrent_batches(self) -> int:
        return 2

    def check_in_flight(self) -> None:
        """Every request of a batch in flight still runs (or was finished from outside)
        and holds its blocks."""
        assert self.core is not None
        pool = self.core.scheduler.kv_cache_manager.block_pool
        for sched in self.in_flight:
            for req in sched.scheduled_requests:
                assert req.status == RequestStatus.RUNNING or req.is_finished(), (
                    f"{req.request_id} in flight became {req.status.name}"
                )
                for block_id in sched.block_tables[req.request_id]:
                    assert pool.blocks[block_id].ref_cnt > 0, (
                        f"block {block_id} of {req.request_id} freed while in flight"
                    )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit_step(scheduler_output).result()

    def submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        self.check_in_flight()
        busy = {r.request_id for s in self.in_flight for r in s.scheduled_requests}
        ids = {r.request_id for r in scheduler_output.scheduled_requests}
        assert not ids & busy, f"{ids & busy} scheduled while in flight"
        assert len(self.in_flight) < 2
        if self.in_flight and all(
                n == 1 for s in (*self.in_flight, scheduler_output)
                for n in s.num_scheduled_tokens.values()):
            self.overlapped_decodes += 1
        self.in_flight.append(scheduler_output)
        out = ModelRunnerOutput()
        for req in scheduler_output.scheduled_requests:
            n = scheduler_output.num_scheduled_tokens[req.request_id]
            if req.num_computed_tokens + n == req.num_tokens:
                index = int(req.request_id[1:])
                out.sampled_token_ids[req.request_id] = (index * 7 + req.num_output_tokens) % 40 + 8
        self.steps.append(dict(scheduler_output.num_scheduled_tokens))
        future = _Landing(self, scheduler_output)
        future.set_result(out)
        return future


class _Landing(Future[ModelRunnerOutput]):
    """A done future whose ``result()`` marks its batch no longer in flight (the engine
    calls it once, when it applies the batch)."""

    def __init__(self, fake: PipelinedFake, sched: SchedulerOutput) -> None:
        super().__init__()
        self._fake, self._sched = fake, sched

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        assert self._fake.in_flight[0] is self._sched, "batches are applied in order"
        self._fake.check_in_flight()
        self._fake.in_flight.pop(0)
        return super().result(timeout)


def make_core(num_blocks: int, batches: int) -> tuple[EngineCore, PipelinedFake]:
    fake = PipelinedFake(make_facts(max_model_len=64), num_blocks=num_blocks, script={})
    core = EngineCore(make_config(), fake)
    fake.core = core
    core.max_concurrent_batches = batches
    return core, fake


def run(core: EngineCore, on_step: Any = None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step is not None:
            on_step()
    return tokens


def add_requests(core: EngineCore, names: list[int]) -> list[str]:
    prompts = [[1, 2, 3, 4, 5, 6, 9], [1, 2, 3, 4, 8], list(range(10, 23)), [3], [4, 5, 6]]
    ids = []
    for i, name in enumerate(names):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        core.add_request(Request(f"r{name}", prompts[i % len(prompts)], params))
        ids.append(f"r{name}")
    return ids


def _free_all(core: EngineCore) -> bool:
    pool = core.scheduler.kv_cache_manager.block_pool
    return pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("num_blocks", [64, 7], ids=["roomy", "preempting"])
def test_two_batches_in_flight_give_the_single_batch_tokens(num_blocks: int) -> None:
    """Chunked prefill (8-token budget), shared prefixes and (7 blocks) preemption: the
    same tokens as one batch at a time, two batches were in flight, blocks balance."""
    single, _ = make_core(num_blocks, 1)
    add_requests(single, list(range(5)))
    want = run(single)
    assert single.max_num_batches_in_flight == 0

    core, fake = make_core(num_blocks, 2)
    add_requests(core, list(range(5)))
    got = run(core)
    assert got == want
    assert core.max_num_batches_in_flight == 2
    assert fake.in_flight == [] and _free_all(core)
    if num_blocks == 7:
        assert core.get_stats().num_preemptions > 0, "the test must preempt"
    core.shutdown()


def test_decodes_split_over_the_batches() -> None:
    """Four requests admitted in one batch decode as two batches of two in flight, not
    one batch of four and an empty one."""
    core, fake = make_core(64, 2)
    for i in range(4):
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        core.add_request(Request(f"r{i}", [i + 1], params))
    run(core)
    assert fake.steps[0] == {f"r{i}": 1 for i in range(4)}
    assert all(len(step) == 2 for step in fake.steps[1:])
    assert fake.overlapped_decodes > 0
    core.shutdown()


def test_abort_in_flight_frees_after_the_batch() -> None:
    """A request aborted while its batch is in flight keeps its blocks until the batch is
    applied; its id stays taken until then; the others' tokens are unchanged."""
    single, _ = make_core(64, 1)
    add_requests(single, list(range(4)))
    want = run(single)

    core, fake = make_core(64, 2)
    ids = add_requests(core, list(range(4)))
    while core.num_batches_in_flight < 2:
        core.step()
    victim = fake.in_flight[0].scheduled_requests[0]
    blocks = fake.in_flight[0].block_tables[victim.request_id]
    core.abort_requests([victim.request_id])
    assert victim.get_finish_reason() == "abort"
    pool = core.scheduler.kv_cache_manager.block_pool
    assert all(pool.blocks[b].ref_cnt > 0 for b in blocks), "freed under the batch in flight"
    with pytest.raises(ValueError, match="already in the engine"):
        core.scheduler.check_request_id(victim.request_id)
    got = run(core)
    assert victim.request_id not in got or len(got[victim.request_id]) < 6
    for rid in ids:
        if rid != victim.request_id:
            assert got[rid] == want[rid]
    assert _free_all(core)
    core.shutdown()


def test_abort_everything_in_flight_then_shutdown_frees_all() -> None:
    core, fake = make_core(64, 2)
    ids = add_requests(core, list(range(4)))
    while core.num_batches_in_flight < 2:
        core.step()
    core.abort_requests(ids)
    assert core.has_unfinished_requests(), "batches in flight must still be applied"
    core.shutdown()
    assert fake.in_flight == [] and _free_all(core)


def test_max_concurrent_batches_is_checked() -> None:
    core, _ = make_core(16, 2)
    for bad in (0, 3):
        with pytest.raises(ValueError, match="max_concurrent_batches must be in"):
            core.max_concurrent_batches = bad
    add_requests(core, [0, 1])
    core.step()
    with pytest.raises(RuntimeError, match="in flight"):
        core.max_concurrent_batches = 1
    core.shutdown()
