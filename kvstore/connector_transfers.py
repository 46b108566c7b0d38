"""The store connector's transfer threads (kvstore/connector.py names the parts): the
state both connector sides share, the jobs they hand over, and the moves themselves.

A save uploads the blocks the store lacks and sets the request's publish marker; a load
fetches blocks in order up to the first miss, and a load whose prefill still publishes
parks (once) in an :class:`~tandem.kvstore.arrival.ArrivalWaiter` off the transfer
threads. A CPU cache is read and written in place; anything else (a GPU cache, several
ranks' shards) moves through a per-thread host staging buffer in chunks of at most
:data:`STAGING_BYTES`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.contracts.block_key import BlockKey
from tandem.engine.kv_connector import LoadResult, SaveResult, TransferListener
from tandem.engine.kv_shards import ShardedKVCache
from tandem.kvstore.arrival import ArrivalSignal, ArrivalWaiter
from tandem.kvstore.store import BlockStore
from tandem.kvstore.transfer_path import KVTransferPath, KVTransferPlan, plan_kv_transfer

if TYPE_CHECKING:
    from tandem.kvstore.connector_lookups import _Lookups

# the connector's parts log under one name (kvstore/connector.py's)
logger = logging.getLogger("tandem.kvstore.connector")

#: Host staging per transfer thread for a sharded (or GPU) cache, in bytes: a transfer
#: moves in chunks of at most this size (one block at least), reusing one buffer.
STAGING_BYTES = 64 << 20


@dataclass
class _Job:
    """One request's transfer: parallel lists, one entry per block.

    ``first_block`` is the block index (in the request's hash chain) of ``keys[0]``.
    ``marker_key``: a producer's publish marker to set when the save ends, or the one a
    load waits for. ``wait``: a load may park on a miss (once). ``num_done`` /
    ``num_bytes``: leading blocks a load brought so far, and their bytes.
    ``wait_outcome`` / ``wait_ns``: how its wait ended and how long it took (ns);
    ``parked_ns``: ``time.monotonic_ns()`` when it was parked. ``trace_headers``: the
    request's ``Request.trace_headers`` (the service traces), else ``None``.
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
    trace_headers: dict[str, str] | None = None



class _Transfers:
    """The transfer threads and the state both connector sides share.

    Thread-safety: ``submit``/``cancel``/``get_finished`` come from the engine
    thread, ``_run`` runs on ``num_threads`` transfer threads (the store client
    is thread-safe); ``_lock`` guards the shared sets and the client's creation.
    """

    def __init__(
        self, client_factory: Callable[[], BlockStore], num_threads: int = 2,
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
        self._client: BlockStore | None = None
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

    def _client_or_connect(self) -> BlockStore:
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
            blocks = [self.kv_cache[b] for b in job.block_ids]
            if job.trace_headers:
                return client.put_blocks(job.keys, blocks, trace_headers=job.trace_headers)
            return client.put_blocks(job.keys, blocks)
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
