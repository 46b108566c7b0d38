"""The batch one ``Scheduler.schedule`` call builds: requests, their tokens and the
budget left, filled by the running pass, then by admission of waiting requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.engine.request import Request


@dataclass
class StepBatch:
    """A step's batch under construction (fields as ``SchedulerOutput``'s of the same
    names; every count in tokens).

    Attributes:
        budget: tokens the step may still schedule (starts at ``max_num_batched_tokens``).
        scheduled: requests in batch order.
        num_scheduled: request id -> tokens to compute (drafts included).
        spec_tokens: request id -> draft tokens verified this step.
        lookahead: request id -> draft tokens the proposer may propose after the step.
        preempted: requests preempted for blocks this step.
    """

    budget: int
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    lookahead: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    def add(
        self, req: Request, num_new: int, drafts: Sequence[int] = (), num_ahead: int = 0
    ) -> None:
        """Schedule ``num_new`` known tokens of ``req`` and ``drafts`` after them."""
        rid = req.request_id
        self.scheduled.append(req)
        self.num_scheduled[rid] = num_new + len(drafts)
        self.budget -= num_new + len(drafts)
        if drafts:
            self.spec_tokens[rid] = list(drafts)
        if num_ahead:
            self.lookahead[rid] = num_ahead

    def take_back(self, req: Request) -> None:
        """Unschedule ``req`` (preempted after it was scheduled): its tokens return to
        the budget. A request not in the batch is ignored."""
        rid = req.request_id
        if rid not in self.num_scheduled:
            return
        self.budget += self.num_scheduled.pop(rid)
        self.scheduled.remove(req)
        self.spec_tokens.pop(rid, None)
        self.lookahead.pop(rid, None)

    def drop_drafts(self) -> None:
        """Verify no draft this step: each request keeps its known tokens only (the
        drafts' KV slots stay allocated, for the tokens that come next anyway)."""
        for rid, drafts in self.spec_tokens.items():
            self.num_scheduled[rid] -= len(drafts)
            self.budget += len(drafts)
        self.spec_tokens = {}
