"""The scheduler's side of the batch queue: which requests are in a batch in flight.

With ``max_concurrent_batches`` > 1 (pipeline parallelism; vLLM v1's
``step_with_batch_queue``) the engine core schedules the next batch before the previous
one's results came back. A request whose tokens are in a batch in flight is not
scheduled again, nor chosen for preemption, until that batch was applied; each batch
takes at most ``ceil(running / max_concurrent_batches)`` running requests, so decodes
split over the batches instead of all landing in the first one. A request finished from
outside while in flight (an abort) keeps its blocks until its batch was applied: the
workers may still write them, and neither the connector nor another request may have
them before. With one batch at a time nothing is ever in flight here.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.engine.request import Request
from tandem.engine.sched_output import SchedulerOutput


class BatchesInFlight:
    """Requests in scheduled batches not yet applied, and the finished ones among them.

    Args:
        max_concurrent_batches: batches the engine core keeps in flight; 1: each batch is
            applied before the next is scheduled.

    Raises:
        ValueError: ``max_concurrent_batches`` < 1.
    """

    def __init__(self, max_concurrent_batches: int) -> None:
        self._max = 1
        self.max_concurrent_batches = max_concurrent_batches
        self._in_flight: set[str] = set()
        # finished requests whose blocks wait for their batch to be applied
        self._free_after_batch: dict[str, Request] = {}

    @property
    def max_concurrent_batches(self) -> int:
        """Batches kept in flight at most (1: one at a time)."""
        return self._max

    @max_concurrent_batches.setter
    def max_concurrent_batches(self, value: int) -> None:
        """Raises: ValueError naming ``max_concurrent_batches`` when < 1."""
        if value < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {value}")
        self._max = value

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def holds(self, request_id: str) -> bool:
        """Whether a finished request of this id still waits for its batch (its id is
        then still in use)."""
        return request_id in self._free_after_batch

    @property
    def has_held_blocks(self) -> bool:
        """Finished requests keep blocks until their batch is applied."""
        return bool(self._free_after_batch)

    def schedulable(self, running: list[Request]) -> list[Request]:
        """The running requests not in a batch in flight: ``running`` itself (the same
        list) when none is."""
        if not self._in_flight:
            return running
        return [r for r in running if r.request_id not in self._in_flight]

    def share(self, candidates: list[Request], num_running: int) -> list[Request]:
        """The first of ``candidates`` this batch may take: a ``1 / max_concurrent_batches``
        share of the ``num_running`` requests (rounded up), so the next batch gets some."""
        if self._max == 1:
            return candidates
        return candidates[: -(-num_running // self._max)]

    def add(self, request_ids: Iterable[str]) -> None:
        """A batch of these requests was scheduled (kept only with batches ahead)."""
        if self._max > 1:
            self._in_flight.update(request_ids)

    def land(self, sched: SchedulerOutput) -> list[Request]:
        """``sched`` was applied: its requests are no longer in flight.

        Returns:
            The requests finished while it was in flight: their blocks may be freed now.
        """
        if not self._in_flight:
            return []
        finished = []
        for req in sched.scheduled_requests:
            rid = req.request_id
            self._in_flight.discard(rid)
            done = self._free_after_batch.pop(rid, None)
            if done is not None:
                finished.append(done)
        return finished

    def keep_until_landed(self, req: Request) -> bool:
        """Keep a finished request's blocks while a batch in flight still writes them.

        Returns:
            True: kept (freed through :meth:`land`); False: not in flight, free them now.
        """
        if req.request_id not in self._in_flight:
            return False
        self._free_after_batch[req.request_id] = req
        return True
