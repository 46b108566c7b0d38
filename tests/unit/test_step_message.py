"""The multi-process executor's step messages: a worker's ``RequestMirror`` rebuilds,
step after step, the ``SchedulerOutput`` the engine core scheduled (requests, computed
tokens, outputs, block tables), through pickling as the shared-memory queue does, across
chunked prefill, preemption, finished requests and a request id used again."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from test_executor import FakeExecutor, make_facts, make_request

from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor.step_message import RequestMirror, StepEncoder
from tandem.engine.request import Request
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput


def _state(req: Request) -> tuple[Any, ...]:
    return (req.request_id, req.all_token_ids, req.output_token_ids, req.num_computed_tokens,
            req.sampling_params, req.eos_token_id, req.num_output_tokens)


class MirroringExecutor(FakeExecutor):
    """A ``FakeExecutor`` that sends each step through a ``StepEncoder``, pickles it and
    decodes it in a ``RequestMirror``, checking the rebuilt step against the original."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.encoder = StepEncoder()
        self.mirror = RequestMirror()
        self.new_per_step: list[int] = []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        msg = pickle.loads(pickle.dumps(self.encoder.encode(scheduler_output)))
        self.new_per_step.append(len(msg.new_requests))
        got = self.mirror.decode(msg)
        assert [_state(r) for r in got.scheduled_requests] == [
            _state(r) for r in scheduler_output.scheduled_requests
        ]
        for name in ("num_scheduled_tokens", "block_tables", "total_num_scheduled_tokens",
                     "preempted_req_ids", "finished_req_ids"):
            assert getattr(got, name) == getattr(scheduler_output, name), name
        assert len(self.mirror) == self.encoder.num_known
        return super().execute_model(scheduler_output)


def test_mirror_follows_the_engine_through_preemption_and_finished_requests() -> None:
    # 6 blocks of 4 tokens for 3 requests that grow to 3-4 blocks each: preemption.
    config = EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4))
    reqs = [make_request(list(range(10 + i, 17 + i)), max_tokens=8, seed=i, temperature=0.7)
            for i in range(3)]
    fake = MirroringExecutor(make_facts(vocab_size=50, max_model_len=32), num_blocks=6,
                             script={r.request_id: [20 + j for j in range(8)] for r in reqs})
    core = EngineCore(config, fake)
    for r in reqs:
        core.add_request(r)
    done: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert all(len(done[r.request_id]) == 8 for r in reqs)
    assert sum(r.num_preemptions for r in reqs) > 0, "the test must preempt"
    # Each request is sent in full once only (preemption keeps the workers' copy).
    assert sum(fake.new_per_step) == 3
    # The same id again, a new request: sent in full again, the old copy replaced.
    again = Request(reqs[0].request_id, [5, 6, 7], reqs[0].sampling_params)
    core.add_request(again)
    while core.has_unfinished_requests():
        core.step()
    assert sum(fake.new_per_step) == 4
    core.step()  # nothing scheduled: finished ids reach the workers with the next step
    core.add_request(make_request([1, 2], max_tokens=1))
    while core.has_unfinished_requests():
        core.step()
    assert len(fake.mirror) <= 1, "finished requests are forgotten by the workers"


def test_encoder_refuses_outputs_that_shrink() -> None:
    enc = StepEncoder()
    req = make_request([1, 2, 3])
    sched = SchedulerOutput(scheduled_requests=[req], num_scheduled_tokens={req.request_id: 3})
    req.append_output_token(4)
    enc.encode(sched)
    req.output_token_ids.clear()
    with pytest.raises(ValueError, match="output tokens shrank"):
        enc.encode(sched)
