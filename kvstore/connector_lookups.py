"""The store connector's index lookups (kvstore/connector.py names the parts): waiting
requests' store lookups on a thread of their own, and the prefetch of a prompt that
arrives during a step. A lookup whose run ends inside blocks an earlier turn is still
publishing parks in an :class:`~tandem.kvstore.arrival.ArrivalWaiter`, once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.block_key import BlockKey, PublishInFlight
from tandem.engine.request import Request
from tandem.kvstore.arrival import ArrivalWaiter
from tandem.kvstore.index import output_marker_key

if TYPE_CHECKING:
    from tandem.kvstore.connector_transfers import _Transfers

# the connector's parts log under one name (kvstore/connector.py's)
logger = logging.getLogger("tandem.kvstore.connector")

#: ``keys -> number of leading keys the store holds`` (an index lookup, metadata only;
#: 0 on any failure): :meth:`tandem.kvstore.lookup.IndexProbe.leading`.
StoreProbe = Callable[[Sequence[BlockKey]], int]


@dataclass(eq=False)  # compared by identity
class _Ask:
    """One lookup asked: blocks ``[start, stop)`` of the chain (or a callable making
    it) and the request's :class:`PublishInFlight` hint."""

    key: _LookupKey
    start: int
    stop: int
    chain: list[BlockHash] | Callable[[], list[BlockHash]]
    fingerprint: bytes
    hint: PublishInFlight | None


class _Lookups:
    """Store index lookups of waiting requests, on their own thread.

    Entries are keyed by request id and by the ``Request`` object itself (its
    identity, pinned by the entry): a prefetch from the service thread for a second
    request that reuses an id in flight can then never answer for the first.

    A lookup of a request with a ``kv_publish_in_flight`` hint whose leading run ends
    inside the hinted blocks (an earlier turn's output publish has not committed them
    yet) is parked in an :class:`~tandem.kvstore.arrival.ArrivalWaiter` until those
    blocks are in the index, the publish's end marker is set, or ``kv_load_wait_s``
    passed; then it asks again and answers. Without an arrival signal, or with
    ``kv_load_wait_s`` 0, it answers at once (the missing blocks are recomputed).

    Thread-safety: ``get``/``pop`` come from the engine thread, ``prefetch`` from any
    thread, the probe runs on the lookup thread, the waiter on its own; ``_lock`` guards
    the two dicts and the wait counts.
    """

    def __init__(self, probe: StoreProbe, transfers: _Transfers, block_size: int = 0) -> None:
        self._probe = probe
        self._transfers = transfers  # for its listener
        self._block_size = block_size
        # asked lookups; None stops the thread
        self._queue: queue.Queue[_Ask | None] = queue.Queue()
        self._lock = threading.Lock()
        # key -> (start block of the lookup asked, its request: pins the id)
        self._pending: dict[_LookupKey, tuple[int, Request]] = {}
        self._done: dict[_LookupKey, tuple[_Found, Request]] = {}
        # requests whose lookup parked once for their hint's publish: a later lookup of
        # theirs (from the local prefix-cache hit, after a prefetch from block 0) does
        # not wait again, so a request waits at most kv_load_wait_s in all
        self._parked_once: set[_LookupKey] = set()
        #: waits for an in-flight publish, by how they ended (arrival.py's outcomes)
        self.wait_outcomes: dict[str, int] = {}
        signal = getattr(transfers, "signal", None)
        wait_s = getattr(transfers, "load_wait_s", 0.0)
        self._waiter: ArrivalWaiter[_Ask] | None = (
            ArrivalWaiter(signal, wait_s, self._waited, self._gone, name="kv-lookup-wait")
            if signal is not None and wait_s > 0 else None)
        self._thread = threading.Thread(target=self._run, name="kv-index-lookup", daemon=True)
        self._thread.start()

    def get(self, request: Request, start: int, stop: int,
            hashes: Callable[[], list[BlockHash]], fingerprint: bytes) -> _Found | None:
        """The lookup of blocks ``[start, stop)`` if it answered; else start it (once) and
        return ``None``. ``hashes()`` gives the full-block hash chain (called only to
        start a lookup).

        An answered lookup from an earlier block (a ``prefetch`` from block 0) answers
        for ``start`` too when its leading run reaches past ``start``: the store holds
        those blocks, and the run from ``start`` is its rest. One still running is
        waited for; one whose run ends before ``start`` is followed by a lookup from
        ``start``."""
        key = _key(request)
        with self._lock:
            entry = self._done.get(key)
            if entry is not None:
                found = entry[0]
                if found.start == start:
                    return found
                end = found.start + found.num_blocks
                if found.start < start < end:
                    return _Found(start, min(end, stop) - start, found.hashes)
            pending = self._pending.get(key)
            if pending is not None and pending[0] <= start:
                return None
            self._pending[key] = (start, request)
            self._done.pop(key, None)
        self._queue.put(_Ask(key, start, stop, hashes(), fingerprint,
                             request.kv_publish_in_flight))
        return None

    def prefetch(self, request: Request, stop: int, hashes: Callable[[], list[BlockHash]],
                 fingerprint: bytes) -> None:
        """Start the lookup of blocks ``[0, stop)`` now, from any thread (a request that
        arrives during a step is looked up while that step runs, so the next step can
        admit it). ``hashes()`` runs on the lookup thread."""
        key = _key(request)
        with self._lock:
            if key in self._pending or key in self._done:
                return
            self._pending[key] = (0, request)
        self._queue.put(_Ask(key, 0, stop, hashes, fingerprint, request.kv_publish_in_flight))

    def pop(self, request: Request) -> _Found | None:
        """Forget ``request``'s lookup; its answer if it had one."""
        key = _key(request)
        with self._lock:
            waiting = self._pending.pop(key, None) is not None
            entry = self._done.pop(key, None)
            self._parked_once.discard(key)
        if waiting and self._waiter is not None:
            self._waiter.wake()  # a parked lookup of it goes back at once
        return None if entry is None else entry[0]

    def wait_counts(self) -> dict[str, int]:
        """A copy of :attr:`wait_outcomes` (any thread)."""
        with self._lock:
            return dict(self.wait_outcomes)

    def __len__(self) -> int:
        """Lookups asked or answered and not yet forgotten."""
        with self._lock:
            return len(self._pending) + len(self._done)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.close()  # parked lookups come back as "closed" and answer
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _gone_locked(self, ask: _Ask) -> bool:
        """Whether ``ask`` is no longer wanted (its request finished, or a lookup from
        another block replaced it). Caller holds ``_lock``."""
        pending = self._pending.get(ask.key)
        return pending is None or pending[0] != ask.start

    def _gone(self, ask: _Ask) -> bool:
        """:meth:`_gone_locked` for the waiter's thread."""
        with self._lock:
            return self._gone_locked(ask)

    def _may_park(self, ask: _Ask) -> bool:
        """Whether ``ask`` may park (it is still wanted and its request never parked);
        if so, its request is marked as having parked."""
        with self._lock:
            if self._gone_locked(ask) or ask.key in self._parked_once:
                return False
            self._parked_once.add(ask.key)
            return True

    def _waited(self, ask: _Ask, outcome: str) -> None:
        """The waiter hands a parked lookup back: count it, ask the index again (it
        does not park again: its request is in ``_parked_once``)."""
        with self._lock:
            self.wait_outcomes[outcome] = self.wait_outcomes.get(outcome, 0) + 1
        if outcome != "cancelled":
            self._queue.put(ask)

    def _keys_to_wait_for(self, ask: _Ask, hashes: list[BlockHash], found: int
                          ) -> list[BlockKey]:
        """The blocks a lookup that found ``found`` leading blocks waits for: those of
        its hint's in-flight publish from the first miss on; none when it has no usable
        hint or missed a block the publish does not bring (whether it may still park is
        :meth:`_may_park`'s)."""
        hint = ask.hint
        if (self._waiter is None or hint is None
                or hint.layout_fingerprint != ask.fingerprint
                or hint.block_size != self._block_size):
            return []
        lo, hi = ask.start + found, min(ask.stop, hint.end_block)
        if lo < hint.first_block or lo >= hi:
            return []
        return [BlockKey(h, ask.fingerprint) for h in hashes[lo:hi]]

    def _run(self) -> None:
        while (ask := self._queue.get()) is not None:
            self._answer(ask)
        # NOTE: a lookup that was parking as close() stopped the waiter comes back
        # ("closed") behind the None; the ones left are answered before the thread ends
        # (they cannot park again: their request is in _parked_once)
        while True:
            try:
                ask = self._queue.get_nowait()
            except queue.Empty:
                return
            if ask is not None:
                self._answer(ask)

    def _answer(self, ask: _Ask) -> None:
        """Probe the index for ``ask``; park it on its hint's publish, or record its
        answer (lookup thread)."""
        key, start, stop = ask.key, ask.start, ask.stop
        hashes = ask.chain() if callable(ask.chain) else ask.chain
        ask.chain = hashes
        try:
            n = self._probe([BlockKey(h, ask.fingerprint) for h in hashes[start:stop]])
        except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss
            logger.warning("store lookup of %s failed: %s", key[0], exc)
            n = 0
        n = max(0, min(n, stop - start))
        wait_for = self._keys_to_wait_for(ask, hashes, n)
        if wait_for and self._waiter is not None and self._may_park(ask):
            hint = ask.hint
            assert hint is not None
            self._waiter.park(ask, wait_for,
                              output_marker_key(ask.fingerprint, hint.request_id))
            return
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending[0] != start:
                return  # finished, or a newer lookup was asked meanwhile
            del self._pending[key]
            self._done[key] = (_Found(start, n, hashes), pending[1])
        listener = self._transfers.listener
        if listener is not None:
            listener.on_lookup_done(key[0])


#: A lookup's key: the request id and the identity of its ``Request`` object.
_LookupKey = tuple[str, int]


def _key(request: Request) -> _LookupKey:
    return request.request_id, id(request)


@dataclass(frozen=True)
class _Found:
    """A store lookup of a waiting request: ``num_blocks`` leading blocks present from
    block ``start`` of ``hashes`` (the prompt's full-block hash chain)."""

    start: int
    num_blocks: int
    hashes: list[BlockHash]
