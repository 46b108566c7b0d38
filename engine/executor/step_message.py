"""What one engine step sends to worker processes, and the worker's copy of the requests.

A ``SchedulerOutput`` holds the engine core's ``Request`` objects, which carry state
that cannot or should not cross a process boundary every step (a grammar matcher, a
torch generator, the whole token history). The multi-process executor therefore sends
each request's fixed data once, when a worker first sees it (``NewRequestData``), and
afterwards only what changed: how many tokens are computed, the output tokens appended
since the last message, the block table (vLLM v1 splits its ``SchedulerOutput`` into
new and cached request data the same way). ``StepEncoder`` (engine core side) writes
``StepMessage``s; ``RequestMirror`` (worker side) rebuilds an equal ``SchedulerOutput``
over its own ``Request`` copies, which the model runner and the sampler read as they
read the engine's.

Torch-free except through ``Request`` (whose module imports torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import SchedulerOutput


@dataclass(frozen=True)
class NewRequestData:
    """A request a worker has not seen (or whose id now names another request).

    Attributes:
        request_id: the engine's id.
        prompt_token_ids: the prompt.
        output_token_ids: output tokens it already has (a resumed or migrated request).
        sampling_params: its validated sampling parameters (the sampler reads them).
        eos_token_id: its EOS id (``None`` when unknown).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None


@dataclass(frozen=True)
class ScheduledRequestData:
    """One scheduled request's state this step.

    Attributes:
        request_id: the engine's id.
        num_computed_tokens: tokens whose K/V is in the cache before this step.
        new_output_token_ids: output tokens appended since the worker last saw it.
    """

    request_id: str
    num_computed_tokens: int
    new_output_token_ids: list[int]


@dataclass
class StepMessage:
    """One step for every worker: a ``SchedulerOutput`` without ``Request`` objects.

    Attributes:
        new_requests: requests the workers see for the first time, before ``scheduled``
            refers to them.
        scheduled: the scheduled requests in batch order.
        forget_req_ids: ids whose worker copy can be dropped (finished requests).
        The other fields are ``SchedulerOutput``'s, unchanged.
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequestData] = field(default_factory=list)
    forget_req_ids: set[str] = field(default_factory=set)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: Any = None
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)


class StepEncoder:
    """Engine core side: turns each ``SchedulerOutput`` into a ``StepMessage``, keeping
    what the workers already know of each request.

    Every message must reach every worker in order (the workers' copies advance with
    them); after a lost message the encoder and mirrors disagree, so the executor
    treats a failed send as fatal.
    """

    def __init__(self) -> None:
        # request id -> (the Request object the workers mirror, output tokens they have)
        self._known: dict[str, tuple[Request, int]] = {}

    @property
    def num_known(self) -> int:
        """Requests the workers hold a copy of."""
        return len(self._known)

    def encode(self, sched: SchedulerOutput) -> StepMessage:
        """The message of one step. Call once per step, in step order.

        Raises:
            ValueError: a request whose known output tokens shrank (the engine never
                removes output tokens; a shrink means the mirrors would be wrong).
        """
        msg = StepMessage(
            num_scheduled_tokens=sched.num_scheduled_tokens,
            block_tables=sched.block_tables,
            total_num_scheduled_tokens=sched.total_num_scheduled_tokens,
            preempted_req_ids=sched.preempted_req_ids,
            finished_req_ids=sched.finished_req_ids,
            grammar_bitmask=sched.grammar_bitmask,
            scheduled_spec_token_ids=sched.scheduled_spec_token_ids,
            num_lookahead_tokens=sched.num_lookahead_tokens,
        )
        # NOTE: by status, not only sched.finished_req_ids: the scheduler hands those
        # out once, also in steps that run nothing and so never reach the workers.
        for rid in [rid for rid, (req, _) in self._known.items() if req.is_finished()]:
            del self._known[rid]
            msg.forget_req_ids.add(rid)
        for req in sched.scheduled_requests:
            rid = req.request_id
            known = self._known.get(rid)
            outputs = req.output_token_ids
            if known is None or known[0] is not req:
                # NOTE: identity, not the id: an id may come back for a new request
                # after the old one finished.
                msg.new_requests.append(NewRequestData(
                    rid, list(req.prompt_token_ids), list(outputs), req.sampling_params,
                    req.eos_token_id,
                ))
                new_outputs: list[int] = []
            else:
                sent = known[1]
                if len(outputs) < sent:
                    raise ValueError(
                        f"request {rid!r}: output tokens shrank from {sent} to {len(outputs)}"
                    )
                new_outputs = outputs[sent:]
            self._known[rid] = (req, len(outputs))
            msg.scheduled.append(ScheduledRequestData(rid, req.num_computed_tokens, new_outputs))
        return msg


class RequestMirror:
    """Worker side: the worker's copies of the engine's requests, advanced by each
    ``StepMessage`` in order."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        """The ``SchedulerOutput`` a message stands for, over this worker's copies.

        Raises:
            KeyError: a scheduled request the worker never got (messages out of order).
        """
        for rid in msg.forget_req_ids:
            self._requests.pop(rid, None)
        for new in msg.new_requests:
            req = Request(new.request_id, list(new.prompt_token_ids), new.sampling_params,
                          eos_token_id=new.eos_token_id)
            for token in new.output_token_ids:
                req.append_output_token(token)
            self._requests[new.request_id] = req
        scheduled = []
        for item in msg.scheduled:
            req = self._requests[item.request_id]
            for token in item.new_output_token_ids:
                req.append_output_token(token)
            req.num_computed_tokens = item.num_computed_tokens
            scheduled.append(req)
        return SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=msg.num_scheduled_tokens,
            block_tables=msg.block_tables,
            total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
            preempted_req_ids=msg.preempted_req_ids,
            finished_req_ids=msg.finished_req_ids,
            grammar_bitmask=msg.grammar_bitmask,
            scheduled_spec_token_ids=msg.scheduled_spec_token_ids,
            num_lookahead_tokens=msg.num_lookahead_tokens,
        )
