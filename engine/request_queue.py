"""Waiting queues of the scheduler: FCFS and priority (after vLLM v1 ``request_queue.py``).

Both expose the same small interface so the scheduler never branches on the
policy: ``add`` (arrival), ``prepend`` (a preempted or skipped request goes
back in front of later arrivals), ``peek``/``pop`` (next to schedule),
``remove_many``, ``len``, iteration in scheduling order.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from tandem.engine.request import Request


class RequestQueue(ABC):
    """Requests waiting to be scheduled, in policy order."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Enqueue a newly arrived request."""

    @abstractmethod
    def prepend(self, requests: Iterable[Request]) -> None:
        """Put requests back in front (FCFS) or at their policy position (priority),
        keeping their relative order."""

    @abstractmethod
    def peek(self) -> Request:
        """Next request to schedule. Raises IndexError when empty."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the next request. Raises IndexError when empty."""

    @abstractmethod
    def remove_many(self, requests: Iterable[Request]) -> None:
        """Remove the given requests (O(n)); absent ones are ignored."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in scheduling order."""


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, requests: Iterable[Request]) -> None:
        self._q.extendleft(reversed(list(requests)))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``priority`` value first, then earliest ``arrival_time``, then insertion."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    def prepend(self, requests: Iterable[Request]) -> None:
        # The key (priority, arrival) already places a request where it belongs.
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_many(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._heap = [e for e in self._heap if id(e[3]) not in drop]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for a ``SchedulerConfig.policy`` ("fcfs" or "priority").

    Raises:
        ValueError: unknown policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
