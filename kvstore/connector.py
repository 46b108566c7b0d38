"""The "store" KV connector: prefill publishes KV blocks to the tandem KV store,
decode loads them. It implements the engine's connector interface
(engine/kv_connector.py), which finds it by the name ``"store"``; the engine
never imports this module.

Keys: a block's store key is ``BlockKey(block hash, layout fingerprint)``
(contracts/): the hash chain of the prompt's blocks (``prompt_block_hashes``:
every full block, then the partial last block) and ``KVCacheLayout.fingerprint``,
so blocks of another model or layout are never read. A block's value is the
bytes of ``kv_cache[block_id]`` (all layers, K and V, the whole block even when
only its first tokens are valid).

The engine's cache is either one CPU tensor, whose blocks the store reads and writes
in place (no copy), or a :class:`~tandem.engine.kv_shards.ShardedKVCache` (tensor/
pipeline-parallel ranks' shards, or a cache on a GPU): its blocks move through host
staging buffers in the canonical full-head layout (the full model's, the one the
layout fingerprint names), so engines at any TP/PP share blocks; a save assembles
full blocks from the shards, a load scatters them into every shard (replicas
included).

Producer (prefill, ``kv_producer``): when a request finishes, ``request_finished``
hands its blocks to the transfer thread and returns True (the scheduler keeps
the blocks); the thread asks the store which keys it lacks, uploads those, and
reports the request in ``finished_sending`` (success or failure: the blocks are
freed either way; a failed publish only makes the decode side recompute). The prefill
answers before that (services/prefill/servicer.py); when the put ends, the thread writes
the request's publish marker (ok or failed, kvstore/arrival.py) for a decode waiting on
those blocks.

Store lookups (both roles, ``load_from_store``): a request without block hashes (a
prefill, or a decode instance's local prefill) looks up the full blocks of its prompt
beyond the local prefix-cache hit in the store index (one batched lookup, metadata only:
:class:`~tandem.kvstore.lookup.IndexProbe`) and loads the leading run present, exactly as
a decode loads a prefill's blocks; the loaded blocks join the local prefix cache. The
last prompt token is always computed (it yields the sample). The lookup runs on a thread
of its own: until it answers, ``get_num_new_matched_tokens`` says "not known yet" and the
request waits (other requests keep running), so a slow or unreachable index never stalls
the engine's step loop; the listener's ``on_lookup_done`` wakes the engine.

Consumer (decode, ``kv_consumer``): a request whose ``kv_transfer_params``
(``contracts.block_key.KVTransferParams``) hold the prompt's block hashes under
this engine's layout fingerprint reports the prompt tokens beyond its local
prefix-cache hit as remote. After the scheduler
allocated blocks, the load runs on the transfer thread (other requests keep
decoding); it fetches the blocks in order and stops at the first miss or bad
checksum, reporting the tokens it did load; the scheduler recomputes the rest,
and :attr:`StoreConnectorWorker.num_load_failures` counts such requests. When the
prefill answered before its publish ended (``KVTransferParams.publish_pending``), a
clean miss first parks the load in an :class:`~tandem.kvstore.arrival.ArrivalWaiter`
(up to ``kv_load_wait_s``; no transfer thread is held) and the load goes on with what
arrived.
With ``publish_output``, a finished request's full blocks of prompt + output (the hash
chain continues through the generated tokens) are published on the transfer thread, so
the next turn of a conversation finds them; its response stream is not held up (the
last token is already out), only its blocks stay allocated until the put is done.
Blocks this request itself loaded from the store are not sent again.

Settings: ``kvstore.config.StoreConnectorConfig``, built once by the service's
entry point.
Tests that need another block store register a connector built by
:func:`build_store_connector` with their own client.

NOTE: both sides share one ``_Transfers`` object (they live in one process).
A save is submitted by ``request_finished`` directly instead of through the
next step's metadata: the blocks are final then (the forward that computed them
has returned), and waiting for the next step would add a whole forward pass to
the prefill's time to answer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.contracts.block_hash import BlockHash, hash_token_blocks, prompt_block_hashes
from tandem.contracts.block_key import BlockKey, PublishInFlight
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import KVTransferConfig
from tandem.engine.kv_connector import (
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadResult,
    SaveResult,
    TransferListener,
)
from tandem.engine.kv_shards import ShardedKVCache
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched_output import SchedulerOutput
from tandem.kvstore.arrival import ArrivalSignal, ArrivalWaiter
from tandem.kvstore.config import StoreConnectorConfig
from tandem.kvstore.index import output_marker_key, publish_marker_key
from tandem.kvstore.transfer_path import KVTransferPath, KVTransferPlan, plan_kv_transfer

logger = logging.getLogger(__name__)

#: Host staging per transfer thread for a sharded (or GPU) cache, in bytes: a transfer
#: moves in chunks of at most this size (one block at least), reusing one buffer.
STAGING_BYTES = 64 << 20


class BlockStoreClient(Protocol):
    """What this connector needs from the KV store: ``tandem.kvstore.client.KVStoreClient``,
    the synchronous facade of kvstore's batched ``BlockStore``, callable from a thread.

    All calls block the calling (transfer) thread, never the engine thread.
    """

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Store ``blocks[i]`` (contiguous CPU buffers) under ``keys[i]``; keys already
        present are not sent again. Returns how many blocks are stored. Raises on failure."""

    def get_blocks(self, keys: Sequence[BlockKey], into: Sequence[torch.Tensor]) -> int:
        """Load the leading present blocks into ``into[i]`` (writable contiguous buffers);
        returns how many leading blocks arrived intact (a miss or bad checksum stops it)."""

    def close(self) -> None:
        """Release connections."""


#: ``keys -> number of leading keys the store holds`` (an index lookup, metadata only;
#: 0 on any failure): :meth:`tandem.kvstore.lookup.IndexProbe.leading`.
StoreProbe = Callable[[Sequence[BlockKey]], int]


@dataclass
class _Job:
    """One request's transfer: parallel lists, one entry per block.

    ``first_block`` is the block index (in the request's hash chain) of ``keys[0]``.
    ``marker_key``: a producer's publish marker to set when the save ends, or the one a
    load waits for. ``wait``: a load may park on a miss (once). ``num_done`` /
    ``num_bytes``: leading blocks a load brought so far, and their bytes.
    ``wait_outcome`` / ``wait_ns``: how its wait ended and how long it took (ns);
    ``parked_ns``: ``time.monotonic_ns()`` when it was parked.
    """

    request_id: str
    is_save: bool
    keys: list[BlockKey]
    block_ids: list[int]
    num_tokens: list[int]
    cancelled: bool = False
    first_block: int = 0
    marker_key: str = ""
    wait: bool = False
    num_done: int = 0
    num_bytes: int = 0
    wait_outcome: str | None = None
    wait_ns: int = 0
    parked_ns: int = 0


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


@dataclass
class StoreConnectorMetadata:
    """Loads recorded by the scheduler side in one step: request id -> job."""

    loads: dict[str, _Job] = field(default_factory=dict)


class _Transfers:
    """The transfer threads and the state both connector sides share.

    Thread-safety: ``submit``/``cancel``/``get_finished`` come from the engine
    thread, ``_run`` runs on ``num_threads`` transfer threads (the store client
    is thread-safe); ``_lock`` guards the shared sets and the client's creation.
    """

    def __init__(
        self, client_factory: Callable[[], BlockStoreClient], num_threads: int = 2,
        signal: ArrivalSignal | None = None, load_wait_s: float = 0.0,
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"num_transfer_threads must be >= 1, got {num_threads}")
        if load_wait_s < 0:
            raise ValueError(f"kv_load_wait_s must be >= 0, got {load_wait_s}")
        self._client_factory = client_factory
        self.signal = signal
        self.load_wait_s = load_wait_s
        # Loads missing blocks a prefill still publishes wait here, off the transfer threads.
        self.waiter: ArrivalWaiter[_Job] | None = (
            ArrivalWaiter(signal, load_wait_s, self._waited, lambda job: job.cancelled)
            if signal is not None and load_wait_s > 0 else None)
        self._client: BlockStoreClient | None = None
        self._client_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._finished_recving: dict[str, int] = {}
        self._in_flight: dict[str, _Job] = {}
        # request id -> block indices it loaded whole from the store (not resent)
        self._loaded_blocks: dict[str, range] = {}
        # exactly one of the two is set by register_kv_caches: a CPU cache read and
        # written in place, or a sharded one moved through staging buffers
        self.kv_cache: torch.Tensor | None = None
        self.sharded: ShardedKVCache | None = None
        self.block_size = 0
        self.plan = KVTransferPlan(KVTransferPath.IN_PLACE, False, "no cache attached yet")
        self._staging = threading.local()
        self.listener: TransferListener | None = None
        self.lookups: _Lookups | None = None  # set by the scheduler side, closed here
        self.num_load_failures = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"kv-transfer-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: _Job) -> None:
        with self._lock:
            self._in_flight[job.request_id] = job
        self._queue.put(job)

    def cancel(self, request_id: str) -> bool:
        """Mark a pending load cancelled; True if one is in flight (keep its blocks)."""
        with self._lock:
            job = self._in_flight.get(request_id)
            if job is None:
                return False
            job.cancelled = True
        if self.waiter is not None:
            self.waiter.wake()  # a parked load goes back at once
        return True

    def pop_loaded_blocks(self, request_id: str) -> range:
        """Block indices the request's finished load brought whole from the store."""
        with self._lock:
            return self._loaded_blocks.pop(request_id, range(0))

    def num_pending(self) -> int:
        with self._lock:
            return len(self._in_flight) + len(self._finished_sending) + len(self._finished_recving)

    def get_finished(self) -> tuple[set[str], dict[str, int]]:
        with self._lock:
            sending, recving = self._finished_sending, self._finished_recving
            self._finished_sending, self._finished_recving = set(), {}
        return sending, recving

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        if self.waiter is not None:
            self.waiter.close()  # parked loads are queued before the threads' ends
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=30)
        if self._client is not None:
            self._client.close()
        if self.signal is not None:
            self.signal.close()

    # -- transfer thread ---------------------------------------------------------------------

    def _client_or_connect(self) -> BlockStoreClient:
        with self._client_lock:
            if self._client is None:
                self._client = self._client_factory()
            return self._client

    def _run(self) -> None:
        # Connect before the first request needs it (connection setup is slow);
        # on failure the first transfer retries.
        try:
            self._client_or_connect()
        except Exception as exc:  # noqa: BLE001 - retried by the first transfer
            logger.warning("KV store not reachable yet: %s", exc)
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.is_save:
                self._save(job)
            else:
                self._load(job)

    def attach(self, kv_cache: torch.Tensor | ShardedKVCache) -> None:
        """Serve ``kv_cache`` as ``plan_kv_transfer`` says: a contiguous CPU tensor in
        place, anything else (a GPU cache, several ranks' shards) staged."""
        sharded = (kv_cache if isinstance(kv_cache, ShardedKVCache)
                   else ShardedKVCache.from_tensor(kv_cache))
        whole = sharded.shards[0].tensor
        self.plan = plan_kv_transfer({s.tensor.device.type for s in sharded.shards},
                                     sharded.is_single and whole.is_contiguous())
        if self.plan.path is KVTransferPath.IN_PLACE:
            self.kv_cache, self.sharded = whole, None
            self.block_size = int(whole.shape[3])
        else:
            logger.info("KV store transfers through host staging: %s", self.plan.reason)
            self.kv_cache, self.sharded = None, sharded
            self.block_size = sharded.block_shape[2]

    def _staging_buffer(self, cache: ShardedKVCache, num_blocks: int) -> torch.Tensor:
        """This thread's host staging buffer ``[num_blocks, *block_shape]``: one
        contiguous tensor, so consecutive blocks move as one message or copy."""
        numel = num_blocks * cache.block_bytes // cache.dtype.itemsize
        buf: torch.Tensor | None = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
            buf = torch.empty(numel, dtype=cache.dtype, pin_memory=self.plan.pinned)
            self._staging.buf = buf
        return buf[:numel].view(num_blocks, *cache.block_shape)

    def _chunks(self, cache: ShardedKVCache, n: int) -> list[tuple[int, int]]:
        step = max(1, STAGING_BYTES // cache.block_bytes)
        return [(lo, min(lo + step, n)) for lo in range(0, n, step)]

    def _put(self, job: _Job) -> int:
        """Store the job's blocks; returns how many the store holds. Raises on failure."""
        client = self._client_or_connect()
        if self.kv_cache is not None:
            # NOTE: views of the cache, sent without a copy; the scheduler keeps the
            # blocks allocated until this save reports done.
            return client.put_blocks(job.keys, [self.kv_cache[b] for b in job.block_ids])
        cache = self.sharded
        assert cache is not None, "register_kv_caches was not called"
        stored = 0
        for lo, hi in self._chunks(cache, len(job.keys)):
            buf = self._staging_buffer(cache, hi - lo)
            cache.read_blocks(job.block_ids[lo:hi], buf)
            stored += client.put_blocks(job.keys[lo:hi], list(buf))
        return stored

    def _load_more(self, job: _Job) -> None:
        """Load the job's blocks from ``num_done`` on, up to the first miss; advances
        ``num_done`` and ``num_bytes``. Raises what the store client raises."""
        client = self._client_or_connect()
        keys, ids = job.keys[job.num_done:], job.block_ids[job.num_done:]
        if self.kv_cache is not None:
            # the store writes straight into the cache blocks
            n = client.get_blocks(keys, [self.kv_cache[b] for b in ids])
        else:
            cache = self.sharded
            assert cache is not None, "register_kv_caches was not called"
            n = 0
            for lo, hi in self._chunks(cache, len(keys)):
                buf = self._staging_buffer(cache, hi - lo)
                got = client.get_blocks(keys[lo:hi], list(buf))
                cache.write_blocks(ids[lo:lo + got], buf[:got])
                n += got
                if got < hi - lo:
                    break
        job.num_done += n
        job.num_bytes += n * self._block_bytes()

    def _block_bytes(self) -> int:
        if self.kv_cache is not None:
            return self.kv_cache[0].numel() * self.kv_cache.element_size()
        return self.sharded.block_bytes if self.sharded is not None else 0

    def _save(self, job: _Job) -> None:
        stored, error = 0, None
        try:
            if job.keys:
                stored = self._put(job)
        except Exception as exc:  # noqa: BLE001 - a failed publish is a later miss, not a crash
            logger.warning("publishing KV of %s failed: %s", job.request_id, exc, exc_info=True)
            error = f"{type(exc).__name__}: {exc}"
        result = SaveResult(error is None, len(job.keys), stored, time.monotonic_ns(), error)
        if job.marker_key and self.signal is not None:
            self.signal.mark_published(job.marker_key, error is None)
        with self._lock:
            self._in_flight.pop(job.request_id, None)
            self._finished_sending.add(job.request_id)
        if self.listener is not None:
            self.listener.on_save_done(job.request_id, result)

    def _waited(self, job: _Job, outcome: str) -> None:
        """The waiter hands a parked load back: it loads what arrived (transfer thread)."""
        job.wait_outcome = outcome
        job.wait_ns = time.monotonic_ns() - job.parked_ns
        self._queue.put(job)

    def _load(self, job: _Job) -> None:
        if not job.cancelled:
            missed = False
            try:
                self._load_more(job)
                missed = job.num_done < len(job.keys)
            except Exception as exc:  # noqa: BLE001 - a failed load is a miss: recompute
                logger.warning("loading KV of %s failed: %s", job.request_id, exc, exc_info=True)
            if missed and job.wait and self.waiter is not None:
                # The prefill may still be publishing the rest: wait for it (once).
                job.wait = False
                job.parked_ns = time.monotonic_ns()
                self.waiter.park(job, job.keys[job.num_done:], job.marker_key)
                return
        loaded = sum(job.num_tokens[:job.num_done])
        requested = sum(job.num_tokens)
        result = LoadResult(loaded, requested, time.monotonic_ns(), job.num_bytes,
                            job.wait_outcome, job.wait_ns)
        bs = self.block_size
        whole, left = 0, loaded
        for n in job.num_tokens:
            if n != bs or left < n:
                break
            whole, left = whole + 1, left - n
        with self._lock:
            if whole and not job.cancelled:
                self._loaded_blocks[job.request_id] = range(
                    job.first_block, job.first_block + whole)
            if loaded < requested and not job.cancelled:
                self.num_load_failures += 1
            self._in_flight.pop(job.request_id, None)
            self._finished_recving[job.request_id] = loaded
        if self.listener is not None and not job.cancelled:
            self.listener.on_load_done(job.request_id, result)


class StoreConnectorScheduler(KVConnectorScheduler):
    """Scheduler side: which tokens are remote, what to load, what to publish.

    Args:
        probe: the store index lookup of ``load_from_store`` (``None``: requests without
            block hashes load nothing).
        publish_output: a consumer publishes prompt + output blocks of finished requests.
    """

    def __init__(
        self,
        transfers: _Transfers,
        kv_role: str,
        block_size: int,
        fingerprint: bytes,
        probe: StoreProbe | None = None,
        publish_output: bool = False,
    ) -> None:
        self._transfers = transfers
        self.is_producer = kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_role in ("kv_consumer", "kv_both")
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.publish_output = publish_output and self.is_consumer
        self._loads: dict[str, _Job] = {}
        # Waiting requests' store lookups (one per request and local hit).
        self._lookups = (_Lookups(probe, transfers, block_size)
                         if probe is not None else None)
        transfers.lookups = self._lookups

    def _remote_hashes(self, request: Request) -> tuple[BlockHash, ...] | None:
        params = request.kv_transfer_params
        if not self.is_consumer or params is None or not params.block_hashes:
            return None
        if params.layout_fingerprint != self.fingerprint:
            return None  # another layout's blocks: recompute (the service rejects these)
        return params.block_hashes

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> int | None:
        if request.kv_transfer_params is None:
            return self._store_hit(request, num_computed_tokens)
        # NOTE: optimistic (no store lookup on the step loop): the producer published
        # the whole prompt; a block missing at load time is reported then and recomputed.
        hashes = self._remote_hashes(request)
        if hashes is None:
            return 0
        covered = min(len(hashes) * self.block_size, request.num_prompt_tokens)
        return max(0, covered - num_computed_tokens)

    def prefetch(self, request: Request) -> None:
        """Start the store lookup of a prompt arriving for this engine (thread-safe).

        Only requests that would ask the store at admission (no handoff's
        ``kv_transfer_params``) and have a full block before their last token."""
        if self._lookups is None or request.kv_transfer_params is not None:
            return
        bs = self.block_size
        stop = (len(request.prompt_token_ids) - 1) // bs
        if stop <= 0:
            return
        tokens = list(request.prompt_token_ids[: stop * bs])
        salt = request.cache_salt
        self._lookups.prefetch(request, stop,
                               lambda: hash_token_blocks(tokens, bs, cache_salt=salt),
                               self.fingerprint)

    def drop_prefetch(self, request: Request) -> None:
        """Forget a prefetched lookup of a request the engine did not take."""
        if self._lookups is not None:
            self._lookups.pop(request)

    def _store_hit(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens of the leading run of full blocks after the local hit that the store
        index holds; ``None`` while its lookup (one per request and local hit) runs."""
        if self._lookups is None:
            return 0
        bs = self.block_size
        start = num_computed_tokens // bs
        # full blocks only, and never the last token: the engine computes it
        stop = (request.num_tokens - 1) // bs
        if stop <= start:
            return 0
        tokens = request.all_token_ids
        found = self._lookups.get(request, start, stop,
                                  lambda: hash_token_blocks(tokens[: stop * bs], bs,
                                                            cache_salt=request.cache_salt),
                                  self.fingerprint)
        return None if found is None else found.num_blocks * bs

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        found = self._lookups.pop(request) if self._lookups is not None else None
        hashes: Sequence[BlockHash] | None = self._remote_hashes(request)
        params = request.kv_transfer_params
        # a prefill still publishing these blocks: a miss waits for them (kvstore/arrival.py)
        wait = hashes is not None and params is not None and params.publish_pending
        if hashes is None and found is not None:
            hashes = found.hashes
        assert hashes is not None, f"{rid}: remote tokens without block hashes"
        bs = self.block_size
        start = request.num_computed_tokens
        stop = start + num_external_tokens
        first, last = start // bs, -(-stop // bs)
        assert last <= len(hashes), f"{request.request_id}: load past the remote blocks"
        self._loads[request.request_id] = _Job(
            request_id=request.request_id,
            is_save=False,
            keys=[BlockKey(h, self.fingerprint) for h in hashes[first:last]],
            block_ids=list(block_ids[first:last]),
            num_tokens=[min((i + 1) * bs, stop) - max(i * bs, start) for i in range(first, last)],
            first_block=first,
            wait=wait,
            marker_key=publish_marker_key(BlockKey(hashes[-1], self.fingerprint), rid)
            if wait else "",
        )

    def build_connector_meta(self, sched_out: SchedulerOutput) -> StoreConnectorMetadata | None:
        if not self._loads:
            return None
        meta = StoreConnectorMetadata(loads=self._loads)
        self._loads = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        if self._lookups is not None:
            self._lookups.pop(request)
        if self._loads.pop(rid, None) is not None:
            return False  # its load was never started: nothing writes into the blocks
        if self._transfers.cancel(rid):
            return True  # a load is writing into the blocks: keep them until it reports
        loaded = self._transfers.pop_loaded_blocks(rid)
        tokens = request.all_token_ids[: request.num_computed_tokens]
        marker = ""
        if self.is_producer:
            if request.status == RequestStatus.FINISHED_ABORTED:
                return False  # the prefill handler waits for no save of an abort
            # The prompt: full blocks, then the partial tail (what a decode loads).
            hashes = prompt_block_hashes(tokens, self.block_size,
                                         cache_salt=request.cache_salt)
            if hashes:
                # what a decode that waits for these blocks polls (kvstore/arrival.py)
                marker = publish_marker_key(BlockKey(hashes[-1], self.fingerprint), rid)
        elif self.publish_output:
            # NOTE: an abort too (a stop string ends a stream that way): the KV of the
            # computed tokens is right whatever ended the request.
            hashes = hash_token_blocks(tokens, self.block_size, cache_salt=request.cache_salt)
            if hashes and self._transfers.signal is not None:
                # what the next turn's lookup waits for (PublishInFlight)
                marker = output_marker_key(self.fingerprint, rid)
        else:
            return False
        if not hashes:
            return False
        assert len(hashes) <= len(block_ids), f"{rid}: fewer blocks than computed KV"
        bs = self.block_size
        # A producer always submits (its handler waits for the outcome), even when the
        # store already holds every block; so does an output publish with an end marker
        # (a next turn may wait for it).
        send = [i for i in range(len(hashes)) if i not in loaded]
        if not send and not self.is_producer and not marker:
            return False
        self._transfers.submit(
            _Job(
                request_id=rid,
                is_save=True,
                keys=[BlockKey(hashes[i], self.fingerprint) for i in send],
                block_ids=[block_ids[i] for i in send],
                num_tokens=[min(bs, len(tokens) - i * bs) for i in send],
                marker_key=marker,
            )
        )
        return True


class StoreConnectorWorker(KVConnectorWorker):
    """Worker side: starts loads on the transfer thread and reports finished transfers."""

    def __init__(self, transfers: _Transfers, layout: KVCacheLayout) -> None:
        self._transfers = transfers
        self._layout = layout

    def register_kv_caches(self, kv_cache: torch.Tensor | ShardedKVCache) -> None:
        """Serve ``kv_cache``: a tensor ``[num_blocks, *layout.block_shape]`` (contiguous;
        on CPU the store reads and writes its blocks in place) or a
        :class:`~tandem.engine.kv_shards.ShardedKVCache` whose full block is the
        layout's (moved through host staging buffers).

        Raises:
            ValueError: another block shape or dtype than the layout's, or a tensor that
                is not contiguous.
        """
        expected = self._layout.block_shape
        dtype = getattr(torch, self._layout.dtype)
        if isinstance(kv_cache, ShardedKVCache):
            if kv_cache.block_shape != expected:
                raise ValueError(
                    f"kv_cache's full block must be {expected} (the layout's), got "
                    f"{kv_cache.block_shape}")
            got = kv_cache.dtype
        else:
            if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:]) != expected:
                raise ValueError(
                    f"kv_cache must be [num_blocks, {', '.join(map(str, expected))}], "
                    f"got shape {tuple(kv_cache.shape)}"
                )
            if not kv_cache.is_contiguous():
                raise ValueError("kv_cache must be contiguous (block b = kv_cache[b])")
            got = kv_cache.dtype
        if got != dtype:
            raise ValueError(f"kv_cache must have dtype {dtype} (the layout's), got {got}")
        self._transfers.attach(kv_cache)

    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, StoreConnectorMetadata):
            for job in meta.loads.values():
                self._transfers.submit(job)

    def save_kv(self, meta: object) -> None:
        """Nothing: saves start in ``request_finished`` (see the module's NOTE)."""

    def get_finished(self) -> tuple[set[str], dict[str, int]]:
        return self._transfers.get_finished()

    def set_listener(self, listener: TransferListener | None) -> None:
        """Receive each transfer's outcome (called on the transfer thread)."""
        self._transfers.listener = listener

    def has_pending(self) -> bool:
        """Transfers in flight or finished but not yet collected by ``get_finished``."""
        return self._transfers.num_pending() > 0

    @property
    def num_load_failures(self) -> int:
        """Requests whose remote KV was partly missing or corrupt (recomputed), since start."""
        return self._transfers.num_load_failures

    @property
    def num_loads_waiting(self) -> int:
        """Loads parked until blocks a prefill is still publishing arrive."""
        waiter = self._transfers.waiter
        return 0 if waiter is None else waiter.num_parked()

    @property
    def lookup_waits(self) -> dict[str, int]:
        """Store lookups that waited for an earlier request's output publish
        (``PublishInFlight``), by how the wait ended (kvstore/arrival.py's outcomes)."""
        lookups = self._transfers.lookups
        return {} if lookups is None else lookups.wait_counts()

    def shutdown(self) -> None:
        """Finish queued transfers, stop the transfer thread, close the store client."""
        self._transfers.close()


def build_store_connector(
    kv_role: str,
    layout: KVCacheLayout,
    client_factory: Callable[[], BlockStoreClient],
    num_transfer_threads: int = 2,
    *,
    probe: StoreProbe | None = None,
    publish_output: bool = False,
    signal: ArrivalSignal | None = None,
    load_wait_s: float = 0.0,
) -> tuple[StoreConnectorScheduler, StoreConnectorWorker]:
    """Both sides of a store connector over the client ``client_factory()`` returns.

    The factory is called once, on a transfer thread (connecting may be slow); a
    failed connection is retried by the next transfer. Starts the transfer threads
    (stopped by the worker side's ``shutdown``).

    Args:
        probe: store index lookup for requests without block hashes (``None``: off);
            called on a lookup thread of its own (metadata only: one round trip).
        publish_output: a consumer publishes finished requests' prompt + output blocks.
        signal: the index as kvstore/arrival.py reads and writes it: a producer marks its
            publishes ended there, a consumer waits there for blocks a prefill still
            publishes (``None``: no markers, no waiting); closed by ``shutdown``.
        load_wait_s: how long a consumer's load waits for such blocks, seconds (0: not
            at all; a miss is recomputed at once).

    Raises:
        ValueError: ``num_transfer_threads < 1`` or ``load_wait_s < 0``.
    """
    transfers = _Transfers(client_factory, num_transfer_threads, signal, load_wait_s)
    return (
        StoreConnectorScheduler(transfers, kv_role, layout.block_size, layout.fingerprint,
                                probe, publish_output),
        StoreConnectorWorker(transfers, layout),
    )


def create_connector(
    kv_transfer_config: KVTransferConfig, layout: KVCacheLayout
) -> tuple[StoreConnectorScheduler, StoreConnectorWorker]:
    """Factory of the ``"store"`` connector (registered in engine/kv_connector.py): a
    :class:`~tandem.kvstore.client.KVStoreClient` per :class:`StoreConnectorConfig`.

    Raises:
        ValueError: ``kv_transfer_config.connector_config`` is not a ``StoreConnectorConfig``.
    """
    config = kv_transfer_config.connector_config
    if not isinstance(config, StoreConnectorConfig):
        raise ValueError(
            "connector_config must be a StoreConnectorConfig for the store connector, got "
            f"{type(config).__name__}"
        )

    def connect() -> BlockStoreClient:
        from tandem.kvstore.client import KVStoreClient  # UCX only once a transfer runs

        # With the layout, the client rejects a key or block of another layout.
        return KVStoreClient(
            config.redis_url, layout=layout, local_node=config.kvstore_address,
            timeout_s=config.kvstore_timeout_s, options=config.client_options,
        )

    probe = None
    if config.load_from_store:
        from tandem.kvstore.lookup import IndexProbe

        index = IndexProbe(config.redis_url, timeout_s=config.lookup_timeout_s)
        threading.Thread(target=index.warm, name="kv-index-warm", daemon=True).start()
        probe = index.leading
    signal = None
    role = kv_transfer_config.kv_role
    if (role in ("kv_producer", "kv_both") or config.kv_load_wait_s > 0
            or config.publish_output):
        from tandem.kvstore.arrival import RedisArrivalSignal

        signal = RedisArrivalSignal(config.redis_url, timeout_s=config.lookup_timeout_s)
    return build_store_connector(
        role, layout, connect, config.num_transfer_threads,
        probe=probe, publish_output=config.publish_output,
        signal=signal, load_wait_s=config.kv_load_wait_s,
    )
