"""Waiting for KV blocks a prefill is still publishing: the decode side of an early answer.

A prefill answers with its first token as soon as it is sampled and publishes the
prompt's blocks in the background (services/prefill/servicer.py), so a decode's load may
find blocks that are not in the store yet. Such a load (``KVTransferParams.
publish_pending``) is parked in an :class:`ArrivalWaiter` instead of ending: the waiter
polls the store index for the missing blocks (one Redis round trip per poll for all
parked loads, every 1 ms at first, the interval doubling up to 10 ms) and hands the load
back to the connector's transfer threads when

- every missing block is in the index (``arrived``: the publish committed them),
- the prefill marked its publish ended (``published``: what is still missing will not
  come, e.g. it was evicted; ``publish_failed``: nothing more will come),
- ``kv_load_wait_s`` passed since the load was parked (``deadline``),
- the index is unreachable (``index_error``: no block can be committed without it), or
- the request was aborted (``cancelled``) or the connector shuts down (``closed``).

The load then takes the blocks that arrived and the scheduler recomputes the rest: a
wait never changes a token, it only trades recomputing for waiting.

Publish markers: when a prefill's put of a request's blocks ends, its transfer thread
sets ``publish_marker_key(last block, request id)`` to ``ok`` or ``failed`` (TTL
:data:`MARKER_TTL_S`); the decode side knows both (the prompt's block hashes and the
request id the router gives both sides). A marker that never comes (the prefill died,
another client chose another request id) only means waiting until the deadline.
The index is the signal, as vLLM's connectors poll their peers' "finished sending"
state; Redis keyspace notifications would need a server setting we do not control.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import redis
from redis.exceptions import RedisError

from tandem.contracts.block_key import BlockKey
from tandem.kvstore.index import LOOKUP_LUA, NODE_PREFIX, parse_lookup
from tandem.kvstore.lookup import leading_live

logger = logging.getLogger(__name__)

#: Lifetime of a publish marker, seconds: it only has to outlive the decode's wait.
MARKER_TTL_S = 120.0
#: First poll interval of a parked load, seconds; doubled after each poll ...
FIRST_POLL_S = 0.001
#: ... up to this (the most a load waits after its blocks arrived, plus a round trip).
MAX_POLL_S = 0.010

MARKER_OK = "ok"
MARKER_FAILED = "failed"


@dataclass(frozen=True)
class Arrival:
    """What one poll found for one parked load.

    Attributes:
        num_present: leading keys (of those polled) that live store nodes hold.
        marker: the prefill's publish marker (``"ok"``, ``"failed"``), ``None`` if unset.
    """

    num_present: int
    marker: str | None


class ArrivalSignal(Protocol):
    """The store index as the waiter reads it and a producer writes its markers.

    Both calls block the calling thread for one Redis round trip (never the engine's).
    """

    def mark_published(self, marker_key: str, ok: bool) -> None:
        """Set the publish marker ``marker_key`` (``ok`` or ``failed``). Never raises: a
        marker that is not written only makes a waiting decode wait until its deadline."""

    def poll(self, waits: Sequence[tuple[Sequence[BlockKey], str]]) -> list[Arrival]:
        """For each ``(keys, marker key)``: the :class:`Arrival` (one round trip for all).

        Raises:
            RedisError, OSError: the index is unreachable; ValueError: a malformed reply.
        """

    def close(self) -> None:
        """Release the connection."""


class RedisArrivalSignal:
    """:class:`ArrivalSignal` over the store's Redis index (a blocking client).

    Args:
        redis_url: the store's index.
        timeout_s: socket connect/read timeout of one call, seconds (> 0).

    Raises:
        ValueError: ``timeout_s <= 0``.
    """

    def __init__(self, redis_url: str, timeout_s: float = 2.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        # NOTE: from_url connects lazily, on the first call (from a transfer thread)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self._lookup = self._redis.register_script(LOOKUP_LUA)

    def mark_published(self, marker_key: str, ok: bool) -> None:
        try:
            self._redis.set(marker_key, MARKER_OK if ok else MARKER_FAILED,
                            px=int(MARKER_TTL_S * 1000))
        except (RedisError, OSError) as exc:
            logger.warning("could not mark the publish %s ended: %s", marker_key, exc)

    def poll(self, waits: Sequence[tuple[Sequence[BlockKey], str]]) -> list[Arrival]:
        pipe = self._redis.pipeline(transaction=False)
        for keys, marker_key in waits:
            self._lookup(keys=[k.redis_key for k in keys], args=[NODE_PREFIX], client=pipe)
            pipe.get(marker_key)
        replies = pipe.execute()
        out = []
        for i, (keys, _) in enumerate(waits):
            entries, nodes = parse_lookup(len(keys), replies[2 * i])
            marker = replies[2 * i + 1]
            out.append(Arrival(leading_live(entries, {n[0] for n in nodes}),
                               marker.decode() if isinstance(marker, bytes) else marker))
        return out

    def close(self) -> None:
        self._redis.close()


T = TypeVar("T")


@dataclass(eq=False)  # compared by identity
class _Parked(Generic[T]):
    item: T
    keys: list[BlockKey]
    marker_key: str
    deadline: float  # time.monotonic() seconds
    next_poll: float
    interval: float


class ArrivalWaiter(Generic[T]):
    """Parked loads and the thread that polls for their missing blocks.

    Args:
        signal: the index (polls of all due loads go out as one call).
        wait_s: how long a parked load waits at most, seconds (> 0).
        ready: ``ready(item, outcome)`` hands a load back (called on the waiter's thread,
            or on the closing thread; must not block); ``outcome`` is one of the names
            in the module docstring.
        cancelled: whether an item's request was aborted (checked at every wake-up).
        name: the polling thread's name.

    Thread-safety: :meth:`park`, :meth:`wake` and :meth:`close` may be called from any
    thread; ``_cond`` guards the parked set.

    Raises:
        ValueError: ``wait_s <= 0``.
    """

    def __init__(self, signal: ArrivalSignal, wait_s: float,
                 ready: Callable[[T, str], None], cancelled: Callable[[T], bool],
                 name: str = "kv-load-wait") -> None:
        if wait_s <= 0:
            raise ValueError(f"kv_load_wait_s must be > 0 to wait, got {wait_s}")
        self._signal = signal
        self._wait_s = wait_s
        self._ready = ready
        self._cancelled = cancelled
        self._cond = threading.Condition()
        self._parked: list[_Parked[T]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def park(self, item: T, keys: Sequence[BlockKey], marker_key: str) -> None:
        """Wait for ``keys`` (the load's missing blocks, in order), then call ``ready``."""
        now = time.monotonic()
        parked = _Parked(item, list(keys), marker_key, now + self._wait_s,
                         now + FIRST_POLL_S, FIRST_POLL_S)
        with self._cond:
            if not self._stop:
                self._parked.append(parked)
                self._cond.notify()
                return
        self._ready(item, "closed")

    def wake(self) -> None:
        """Look at the parked loads now (a request was aborted)."""
        with self._cond:
            self._cond.notify()

    def num_parked(self) -> int:
        with self._cond:
            return len(self._parked)

    def close(self) -> None:
        """Stop the thread; every parked load is handed back (``closed``)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _take_due(self) -> tuple[list[_Parked[T]], list[_Parked[T]]] | None:
        """Block until a parked load is due or cancelled; remove and return (cancelled,
        due) ones; ``None`` once closed (after handing every parked load back)."""
        with self._cond:
            while True:
                if self._stop:
                    left, self._parked = self._parked, []
                    for p in left:
                        self._ready(p.item, "closed")
                    return None
                now = time.monotonic()
                gone = [p for p in self._parked if self._cancelled(p.item)]
                due = [p for p in self._parked if p.next_poll <= now and p not in gone]
                if gone or due:
                    self._parked = [p for p in self._parked if p not in gone and p not in due]
                    return gone, due
                timeout = min((p.next_poll for p in self._parked), default=now + 3600) - now
                self._cond.wait(timeout)

    def _run(self) -> None:
        while True:
            taken = self._take_due()
            if taken is None:
                return
            gone, due = taken
            for p in gone:
                self._ready(p.item, "cancelled")
            if not due:
                continue
            try:
                arrivals = self._signal.poll([(p.keys, p.marker_key) for p in due])
            except (RedisError, OSError, ValueError) as exc:
                logger.warning("KV store index unreachable while waiting for %d loads' "
                               "blocks (they recompute what is missing): %s", len(due), exc)
                for p in due:
                    self._ready(p.item, "index_error")
                continue
            now = time.monotonic()
            keep = []
            for p, a in zip(due, arrivals, strict=True):
                outcome = _outcome(p, a, now)
                if outcome is not None:
                    self._ready(p.item, outcome)
                    continue
                p.interval = min(2 * p.interval, MAX_POLL_S)
                p.next_poll = min(now + p.interval, p.deadline)
                keep.append(p)
            if keep:
                with self._cond:
                    self._parked.extend(keep)


def _outcome(p: _Parked[T], a: Arrival, now: float) -> str | None:
    """How a parked load's wait ends after a poll (``None``: it goes on)."""
    if a.num_present >= len(p.keys):
        return "arrived"
    if a.marker == MARKER_FAILED:
        return "publish_failed"
    if a.marker is not None:
        return "published"
    if now >= p.deadline:
        return "deadline"
    return None
