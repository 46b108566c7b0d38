"""A store node's disk tier: blocks evicted from host RAM, kept as files (kvstore/disk_file.py).

State on the node's event loop; file I/O in threads. Writes are write-behind: an evicted
block's bytes are copied out of its RAM slot into the tier's queue (:meth:`DiskTier.stage`;
the slot is free at once), and one writer thread writes the queue in batches. Until its
file is complete a block is served from that copy, so a reader never waits on a write.
Reads run on threads of their own, never queued behind writes. LRU by bytes: a block
that does not fit pushes the least recently used ones out (files removed). A write that
fails (full device, read-only, I/O error) drops that block and puts the tier in a
degraded state: evictions are dropped as with no disk tier (counted) until
``retry_s`` passes. The model is the write-back host/disk tiers of SGLang's HiCache and
LMCache's local disk backend (written anew).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.kvstore import disk_file as df
from tandem.kvstore.metrics import NodeMetrics

logger = logging.getLogger("tandem.kvstore.server")

#: blocks (at most) written by one hop to the writer thread
WRITE_BATCH_BLOCKS = 64


@dataclass
class DiskBlock:
    """A block of the tier.

    Attributes:
        key: index key string.
        size_bytes: payload bytes.
        checksum: xxh3-64 hex of the payload.
        file_bytes: bytes the file takes (header + payload; what capacity counts).
        staged: the payload while its file is not complete (``None`` once written).
        reads: reads in flight (a block being read is never evicted).
    """

    key: str
    size_bytes: int
    checksum: str
    file_bytes: int
    staged: bytes | None = None
    reads: int = 0


class DiskTier:
    """Blocks on one directory, LRU by bytes, with a write-behind queue.

    Args:
        root: the directory (created and probed by :func:`probe_directory`).
        capacity_bytes: the most file bytes kept.
        metrics: the node's metrics (the disk tier's series are updated here).
        max_staged_bytes: the most bytes waiting for their write; an eviction beyond it
            is dropped (counted ``queue_full``).
        on_drop: called with the keys of blocks that left the tier (evicted, failed
            write, corrupt file), on the loop: the node removes their index entries.
        retry_s: how long the tier stays degraded after a failed write.
    """

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        metrics: NodeMetrics,
        max_staged_bytes: int,
        on_drop: Callable[[list[str]], None],
        retry_s: float = 30.0,
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.metrics = metrics
        self.max_staged_bytes = max_staged_bytes
        self.on_drop = on_drop
        self.retry_s = retry_s
        self.blocks: OrderedDict[str, DiskBlock] = OrderedDict()  # LRU: oldest first
        self.used_bytes = 0
        self.staged_bytes = 0
        self.degraded_until = 0.0
        self._queue: list[DiskBlock] = []
        self._wake = asyncio.Event()
        # NOTE: one writer thread keeps writes and removals of one key in order; reads
        # have threads of their own so that a hit never queues behind a batch of writes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk-write")
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="kvstore-disk-read")
        metrics.tier_capacity_bytes.labels("disk").set(capacity_bytes)

    # -- state ------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        """Whether evictions are dropped (a write failed less than ``retry_s`` ago)."""
        return time.monotonic() < self.degraded_until

    def get(self, key: str) -> DiskBlock | None:
        return self.blocks.get(key)

    def _update_gauges(self) -> None:
        self.metrics.tier_blocks.labels("disk").set(len(self.blocks))
        self.metrics.tier_bytes.labels("disk").set(self.used_bytes)
        self.metrics.disk_degraded.set(1 if self.degraded else 0)

    def add_written(self, header: df.BlockHeader, file_bytes: int) -> None:
        """Register a block whose file is already complete (a restarted node's scan)."""
        self._add(DiskBlock(header.key, header.size_bytes, header.checksum, file_bytes))

    def _add(self, block: DiskBlock) -> None:
        self.blocks[block.key] = block
        self.used_bytes += block.file_bytes
        self._update_gauges()

    def _remove(self, block: DiskBlock, unlink: bool) -> None:
        if self.blocks.get(block.key) is block:
            del self.blocks[block.key]
            self.used_bytes -= block.file_bytes
            if block.staged is not None:
                self.staged_bytes -= block.size_bytes
                block.staged = None
        if unlink:
            self._writer.submit(_unlink, df.block_path(self.root, block.key))
        self._update_gauges()

    def _make_room(self, file_bytes: int) -> bool:
        """Evict LRU blocks (not being read) until ``file_bytes`` more fit."""
        dropped: list[str] = []
        for key in list(self.blocks):
            if self.used_bytes + file_bytes <= self.capacity_bytes:
                break
            b = self.blocks[key]
            if b.reads:
                continue
            self._remove(b, unlink=True)
            dropped.append(key)
        if dropped:
            self.metrics.tier_evictions.labels("disk").inc(len(dropped))
            self.on_drop(dropped)
        return self.used_bytes + file_bytes <= self.capacity_bytes

    def stage(self, key: str, checksum: str, payload: np.ndarray) -> bool:
        """Keep a block evicted from RAM: copy its bytes for the writer (unless its file
        is already here); returns whether the tier holds it now. Never raises for the
        device: a block it cannot keep is counted in ``disk_dropped`` by reason."""
        have = self.blocks.get(key)
        if have is not None and have.checksum == checksum:
            self.blocks.move_to_end(key)
            return True
        if have is not None:
            self._remove(have, unlink=False)  # its file is rewritten below
        reason = None
        file_bytes = df.HEADER.size + len(key.encode()) + payload.nbytes
        if self.degraded:
            reason = "degraded"
        elif self.staged_bytes + payload.nbytes > self.max_staged_bytes:
            reason = "queue_full"
        elif file_bytes > self.capacity_bytes or not self._make_room(file_bytes):
            reason = "full"
        if reason is not None:
            self.metrics.disk_dropped.labels(reason).inc()
            return False
        block = DiskBlock(key, payload.nbytes, checksum, file_bytes, staged=payload.tobytes())
        self.staged_bytes += block.size_bytes
        self._add(block)
        self._queue.append(block)
        self._wake.set()
        return True

    # -- reads ------------------------------------------------------------------------------

    async def read_into(self, key: str, out: np.ndarray) -> bool:
        """Copy block ``key`` into ``out`` (uint8, its size): from the write queue while
        its file is being written, else from its file (checksum verified). Returns
        False on a miss: absent, or the file is gone, truncated or corrupt (dropped,
        counted in ``disk_corrupt_blocks``)."""
        b = self.blocks.get(key)
        if b is None or b.size_bytes != out.nbytes:
            return False
        self.blocks.move_to_end(key)
        if b.staged is not None:
            out[:] = np.frombuffer(b.staged, dtype=np.uint8)
            return True
        b.reads += 1
        try:
            seconds = await asyncio.get_running_loop().run_in_executor(
                self._readers, _timed_read, df.block_path(self.root, key), key, out
            )
        except df.BlockFileError as exc:
            logger.warning("disk tier: %s; dropped", exc)
            self.metrics.disk_corrupt.labels(exc.reason).inc()
            self._drop(b)
            return False
        except OSError as exc:
            logger.warning("disk tier: block %s unreadable (%s); dropped", key, exc)
            self.metrics.disk_corrupt.labels("unreadable").inc()
            self._drop(b)
            return False
        finally:
            b.reads -= 1
        self.metrics.disk_read_latency.observe(seconds)
        self.metrics.disk_read_bytes.inc(b.size_bytes)
        return True

    def _drop(self, b: DiskBlock) -> None:
        if self.blocks.get(b.key) is b:
            self._remove(b, unlink=True)
            self.on_drop([b.key])

    # -- writes -----------------------------------------------------------------------------

    async def run_writer(self) -> None:
        """Write staged blocks in batches until cancelled (the node's task)."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[:WRITE_BATCH_BLOCKS]
                del self._queue[:WRITE_BATCH_BLOCKS]
                # the loop drops a block's copy only after its write: the bytes stay valid
                jobs = [
                    (df.BlockHeader(b.key, b.size_bytes, b.checksum), b.staged)
                    for b in batch
                    if b.staged is not None
                ]
                results = await loop.run_in_executor(self._writer, _write_batch, self.root, jobs)
                self._written(batch, results)

    def _written(self, batch: list[DiskBlock], results: dict[str, float | OSError]) -> None:
        for b in batch:
            outcome = results.get(b.key)
            if outcome is None:
                continue  # dropped before its turn
            current = self.blocks.get(b.key) is b
            if isinstance(outcome, OSError):
                name = os.strerror(outcome.errno) if outcome.errno else type(outcome).__name__
                if not self.degraded:
                    logger.warning(
                        "disk tier: write of %s failed (%s): RAM only for %.0fs",
                        b.key,
                        name,
                        self.retry_s,
                    )
                self.metrics.disk_write_errors.labels(name).inc()
                self.degraded_until = time.monotonic() + self.retry_s
                self._drop(b)
                continue
            self.metrics.disk_write_latency.observe(outcome)
            self.metrics.disk_write_bytes.inc(b.size_bytes)
            if not current:
                # left the tier while its file was written: the removal queued then
                # ran before the write; remove the file now
                if b.key not in self.blocks:
                    self._writer.submit(_unlink, df.block_path(self.root, b.key))
                continue
            assert b.staged is not None, f"block {b.key} written twice"
            self.staged_bytes -= b.size_bytes
            b.staged = None
        self._update_gauges()

    async def flush(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until every staged block is written (a clean stop)."""
        deadline = time.monotonic() + timeout_s
        while self.staged_bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Stop the threads (pending writes finish first)."""
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)


def _timed_read(path: Path, key: str, out: np.ndarray) -> float:
    """:func:`~tandem.kvstore.disk_file.read_block_into` on a read thread; returns its
    seconds (the read and checksum alone, not the wait for a free thread)."""
    t0 = time.perf_counter()
    df.read_block_into(path, key, out)
    return time.perf_counter() - t0


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("disk tier: cannot remove %s: %s", path, exc)


def _write_batch(
    root: Path, jobs: list[tuple[df.BlockHeader, bytes]]
) -> dict[str, float | OSError]:
    """Write each block file; key -> seconds taken, or the OSError it failed with."""
    out: dict[str, float | OSError] = {}
    for header, payload in jobs:
        t0 = time.perf_counter()
        try:
            df.write_block(root, header, payload)
            out[header.key] = time.perf_counter() - t0
        except OSError as exc:
            out[header.key] = exc
    return out
