"""A ``prefill_only`` request (engine/request.py): the engine ends it after token 1 and
reports, in its output's finish reason, whether token 1 ends the request, decided once
by the stop rule against the caller's real sampling params.

Each case is also run the way the prefill service decided it before the engine knew the
notion (the request sent with ``max_tokens = 1, min_tokens = min(min_tokens, 1)``, then
the stop rule run again against the real params), and both answers must agree.
"""

from __future__ import annotations

import dataclasses

import pytest

from tandem.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import ModelRunnerOutput
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode.policy import SpecDecodePolicy
from tandem.engine.stop import check_stop

EOS = 2
PROMPT = list(range(100, 108))


def make_scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4),
        CacheConfig(block_size=4),
        num_blocks=16,
        max_model_len=64,
    )


def run_first_token(sched: Scheduler, req: Request, token: int) -> EngineCoreOutput:
    """Steps the scheduler until ``req`` gets its first token (sampled as ``token``);
    returns that output, and checks the request left the engine with it."""
    sched.add_request(req)
    for _ in range(10):
        so = sched.schedule()
        done = {
            r.request_id
            for r in so.scheduled_requests
            if r.num_computed_tokens + so.num_scheduled_tokens[r.request_id] == r.num_tokens
        }
        outs = sched.update_from_output(
            so, ModelRunnerOutput(sampled_token_ids=dict.fromkeys(done, token))
        )
        if outs:
            (out,) = outs
            assert req.is_finished() and not sched.has_unfinished_requests()
            return out
    raise AssertionError("no first token")


def earlier_service_decision(
    params: SamplingParams, token: int, prompt: list[int] = PROMPT
) -> tuple[str | None, int | None]:
    """(finish reason, stop token id) as the prefill service computed them with a faked
    ``max_tokens = 1``: ``None`` means token 1 does not end the request."""
    sched = make_scheduler()
    req = Request(
        "old",
        prompt,
        dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)),
        eos_token_id=EOS,
    )
    out = run_first_token(sched, req, token)
    req.sampling_params = params
    stop = check_stop(req, sched.max_seq_len)
    reason = None if stop is None else stop.finish_reason
    if out.finish_reason == "stop":
        reason = "stop"
    return reason, None if stop is None else stop.stop_reason


@pytest.mark.parametrize(
    ("params", "token", "reason", "stop_reason"),
    [
        ({"max_tokens": 16}, EOS, "stop", None),
        ({"max_tokens": 1}, 5, "length", None),
        ({"max_tokens": 1}, EOS, "stop", None),
        ({"max_tokens": 5}, 5, "prefill_done", None),
        ({"max_tokens": None}, 5, "prefill_done", None),
        ({"max_tokens": 16, "min_tokens": 2}, EOS, "prefill_done", None),
        ({"max_tokens": 16, "min_tokens": 1}, EOS, "prefill_done", None),
        ({"max_tokens": 1, "min_tokens": 1}, EOS, "length", None),
        ({"max_tokens": 16, "ignore_eos": True}, EOS, "prefill_done", None),
        ({"max_tokens": 16, "stop_token_ids": [9]}, 9, "stop", 9),
        ({"max_tokens": 16, "stop_token_ids": [9], "min_tokens": 1}, 9, "prefill_done", None),
    ],
)
def test_prefill_only_reports_token_1s_stop(params, token, reason, stop_reason) -> None:
    sp = SamplingParams(**params)
    sched = make_scheduler()
    req = Request("a", PROMPT, sp, eos_token_id=EOS, prefill_only=True)
    out = run_first_token(sched, req, token)
    assert out.new_token_ids == [token]
    assert (out.finish_reason, out.stop_reason) == (reason, stop_reason)
    assert req.sampling_params is sp, "the caller's params reach the engine untouched"
    old_reason, old_stop = earlier_service_decision(sp, token)
    assert (
        out.finish_reason if out.finish_reason != "prefill_done" else None,
        out.stop_reason,
    ) == (old_reason, old_stop)


def test_prefill_done_is_finished_but_not_a_final_reason() -> None:
    status = RequestStatus.FINISHED_PREFILL_DONE
    assert RequestStatus.is_finished(status)
    assert RequestStatus.finish_reason(status) == "prefill_done"


def test_a_request_without_prefill_only_goes_on_after_token_1() -> None:
    sched = make_scheduler()
    req = Request("a", PROMPT, SamplingParams(max_tokens=5), eos_token_id=EOS)
    sched.add_request(req)
    so = sched.schedule()
    (out,) = sched.update_from_output(so, ModelRunnerOutput(sampled_token_ids={"a": 5}))
    assert out.finish_reason is None and req.status == RequestStatus.RUNNING


def test_prefill_only_whose_token_1_fills_the_context_finishes_length() -> None:
    prompt = list(range(100, 163))  # 63 tokens: token 1 fills max_model_len 64
    sp = SamplingParams(max_tokens=None)
    req = Request("a", prompt, sp, eos_token_id=EOS, prefill_only=True)
    out = run_first_token(make_scheduler(), req, 5)
    assert out.finish_reason == "length"
    assert earlier_service_decision(sp, 5, prompt) == ("length", None)


def test_prefill_only_proposes_no_drafts() -> None:
    """Drafts after token 1 would never be verified: the request ends with that step
    (what ``max_tokens = 1`` gave a prefill engine with speculative decoding)."""
    policy = SpecDecodePolicy(SpeculativeConfig(num_speculative_tokens=4), max_seq_len=1000)
    params = SamplingParams(max_tokens=500)
    assert policy.num_lookahead(Request("a", PROMPT, params), 1, len(PROMPT)) == 4
    req = Request("b", PROMPT, params, prefill_only=True)
    assert policy.num_lookahead(req, 1, len(PROMPT)) == 0
