"""A store node's disk tier joined to its RAM pool and index (kvstore/disk_tier.py holds the
files): blocks evicted from RAM go to disk and their index entries say so; a get of a
block on disk reads it back into a RAM slot first; a restarted node registers what its
directory holds.

Index entries of disk blocks carry :data:`~tandem.kvstore.index.DISK_SLOT` as their
slot: the index says which tier holds a block. Runs on the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from tandem.kvstore.config import NodeConfig
from tandem.kvstore.disk_file import block_path
from tandem.kvstore.disk_scan import scan_directory
from tandem.kvstore.disk_tier import DiskTier
from tandem.kvstore.index import DISK_SLOT, IndexEntry
from tandem.kvstore.metrics import NodeMetrics
from tandem.kvstore.node_index import NodeIndex
from tandem.kvstore.pool import Entry, PoolFullError, SlotPool

logger = logging.getLogger("tandem.kvstore.server")

#: index entries written per commit when a restarted node registers its disk
_REGISTER_BATCH = 1000


class NodeDisk:
    """The disk tier of one node (``NodeConfig.disk_path`` set).

    Args:
        spawn: runs a coroutine as a task of the node (errors logged).
    """

    def __init__(
        self,
        cfg: NodeConfig,
        pool: SlotPool,
        index: NodeIndex,
        metrics: NodeMetrics,
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
    ) -> None:
        assert cfg.disk_path is not None, "NodeDisk needs NodeConfig.disk_path"
        self.cfg = cfg
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self._spawn = spawn
        self.tier = DiskTier(
            Path(cfg.disk_path),
            cfg.disk_capacity_bytes,
            metrics,
            cfg.disk_write_queue_bytes,
            self._dropped,
        )
        # key -> a promotion in flight (a second get of the key waits for the first)
        self._promoting: dict[str, asyncio.Future[None]] = {}
        # key -> the owner prefix of its RAM index entry, for blocks moved to disk whose
        # index commit has not run yet (see settle)
        self._ram_prefix: dict[str, str] = {}
        index.disk_entries = self.index_entries

    def _entry(self, key: str) -> IndexEntry:
        b = self.tier.blocks[key]
        return IndexEntry(self.cfg.node_id, DISK_SLOT, b.size_bytes, b.checksum)

    def index_entries(self) -> list[tuple[str, IndexEntry]]:
        """(key, index entry) of every disk block not also in RAM (NodeIndex republishes
        and withdraws them)."""
        return [(k, self._entry(k)) for k in self.tier.blocks if k not in self.pool.entries]

    # -- start ------------------------------------------------------------------------------

    async def start(self) -> int:
        """Scan the directory (files verified; bad ones dropped and counted), keep what
        fits the capacity (most recent first), start the writer. Returns blocks kept."""
        found = await asyncio.to_thread(scan_directory, self.tier.root)
        for reason, n in found.corrupt.items():
            self.metrics.disk_corrupt.labels(reason).inc(n)
        over = []
        for header, size in reversed(found.blocks):  # newest first: the oldest go
            if self.tier.used_bytes + size <= self.tier.capacity_bytes:
                self.tier.add_written(header, size)
            else:
                over.append(header.key)
        # add_written appended newest first: restore LRU order (oldest first)
        for key in reversed(list(self.tier.blocks)):
            self.tier.blocks.move_to_end(key)
        if over:
            logger.info("disk tier: %d blocks over --disk-capacity removed", len(over))
            await asyncio.to_thread(_unlink_all, self.tier, over)
        self._spawn(self.tier.run_writer())
        logger.info(
            "disk tier %s: %d blocks, %d bytes kept; %d files dropped as corrupt",
            self.tier.root,
            len(self.tier.blocks),
            self.tier.used_bytes,
            sum(found.corrupt.values()),
        )
        return len(self.tier.blocks)

    async def register(self) -> None:
        """Write the index entries of every disk block (a restarted node's cache)."""
        entries = self.index_entries()
        for i in range(0, len(entries), _REGISTER_BATCH):
            part = entries[i : i + _REGISTER_BATCH]
            await self.index.try_commit([], [(k, e.encode(), 0) for k, e in part])
        if entries:
            logger.info("disk tier: %d blocks registered in the index", len(entries))

    async def flush(self, timeout_s: float) -> None:
        """Finish staged writes (up to ``timeout_s``; the writer task must still run)."""
        await self.tier.flush(timeout_s)

    async def close(self) -> None:
        """Stop the tier's threads (after the node's tasks stopped)."""
        await asyncio.to_thread(self.tier.close)

    # -- RAM -> disk ------------------------------------------------------------------------

    def demote(
        self, evicted: list[Entry]
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]]]:
        """Hand blocks just evicted from RAM to the disk tier. Call before anything is
        written to their slots (the bytes are copied now).

        Returns:
            (index entries to remove: key, owner prefix; index entries to write: key,
            encoded disk entry, TTL 0) for the eviction's commit.
        """
        gone: list[tuple[str, str]] = []
        moved: list[tuple[str, str, int]] = []
        for e in evicted:
            if self.tier.stage(e.key, e.checksum, self.pool.view(e.slot, e.size_bytes)):
                moved.append((e.key, self._entry(e.key).encode(), 0))
                self._ram_prefix[e.key] = self.index.entry(e).owner_prefix
            else:
                gone.append((e.key, self.index.entry(e).owner_prefix))
        return gone, moved

    def settle(
        self, gone: list[tuple[str, str]], moved: list[tuple[str, str, int]]
    ) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]]]:
        """:meth:`demote`'s index changes as they stand at their commit: a block that
        left the disk tier meanwhile (its write failed, or it was evicted) has its RAM
        entry removed instead of a disk entry written."""
        keep: list[tuple[str, str, int]] = []
        gone = list(gone)
        for item in moved:
            prefix = self._ram_prefix.pop(item[0], None)
            if item[0] in self.tier.blocks:
                keep.append(item)
            elif prefix is not None:
                gone.append((item[0], prefix))
        return gone, keep

    def _dropped(self, keys: list[str]) -> None:
        # NOTE: removed only where the index still names the disk slot: an entry that
        # names a RAM slot (the block was read back or put again) is kept
        prefix = f"{self.cfg.node_id}|{DISK_SLOT}|"
        self._spawn(self.index.try_commit([(k, prefix) for k in keys], []))

    # -- disk -> RAM ------------------------------------------------------------------------

    def wants(self, keys: object) -> bool:
        """Whether a get of ``keys`` must read blocks back from disk first (or wait for
        a read back in flight: the block's RAM entry is pending until it lands)."""
        if not isinstance(keys, list):
            return False
        return any(
            isinstance(k, str)
            and (k in self._promoting or (k not in self.pool.entries and k in self.tier.blocks))
            for k in keys
        )

    async def promote(self, keys: list[Any]) -> int:
        """Read the blocks of ``keys`` that are on disk only back into RAM slots (evicting
        to disk as a put does) and index them there; returns how many were read back.
        A block that cannot be read (corrupt, gone) or placed (every slot pinned) stays
        a miss. Never raises for the device."""
        loop = asyncio.get_running_loop()
        todo: list[Entry] = []
        waits: list[asyncio.Future[None]] = []
        evicted: list[Entry] = []
        for k in dict.fromkeys(k for k in keys if isinstance(k, str)):
            if k in self._promoting:
                waits.append(self._promoting[k])
                continue
            b = self.tier.get(k)
            if b is None or k in self.pool.entries:
                continue
            try:
                entry, gone = self.pool.allocate(k, b.size_bytes, b.checksum, None)
            except (PoolFullError, ValueError):
                break
            evicted += gone
            todo.append(entry)
            self._promoting[k] = loop.create_future()
        gone_args, moved = self.demote(evicted)
        self.metrics.evictions.inc(len(evicted))
        try:
            ok = await asyncio.gather(
                *(self.tier.read_into(e.key, self.pool.view(e.slot, e.size_bytes)) for e in todo)
            )
            new = []
            for e, hit in zip(todo, ok, strict=True):
                if hit:
                    self.pool.commit(e)
                    new.append((e.key, self.index.entry(e).encode(), 0))
                else:
                    self.pool.abort(e)
            gone_args, moved = self.settle(gone_args, moved)
            await self.index.try_commit(gone_args, moved + new)
        finally:
            for e in todo:
                fut = self._promoting.pop(e.key)
                fut.set_result(None)
        self.metrics.tier_hits.labels("disk").inc(len(new))
        if waits:
            await asyncio.gather(*waits)
        return len(new)


def _unlink_all(tier: DiskTier, keys: list[str]) -> None:
    for k in keys:
        block_path(tier.root, k).unlink(missing_ok=True)
