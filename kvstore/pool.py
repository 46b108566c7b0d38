"""A store node's host-memory slot pool: fixed-size slots, LRU eviction, read pins, TTL.

One preallocated byte buffer of ``capacity_bytes`` is cut into equal slots the
first time a block arrives (the slot size is the first block's size, or fixed
up front): slots are then views into that buffer, and transfers go straight
between the wire and the slot. The pool is plain single-threaded state owned
by the server's event loop.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class Entry:
    """A committed or pending block in a slot.

    Attributes:
        key: the block's index key string (``BlockKey.redis_key``).
        slot: slot number.
        size_bytes: payload bytes (<= slot size).
        checksum: xxh3-64 of the payload, hex.
        expires_at: ``time.monotonic()`` deadline, or ``None`` without TTL.
        pins: in-flight reads (or the pending write) holding the slot.
        committed: payload complete and the index entry written.
    """

    key: str
    slot: int
    size_bytes: int
    checksum: str
    expires_at: float | None
    pins: int = 0
    committed: bool = False


class PoolFullError(RuntimeError):
    """Every slot is pinned by in-flight transfers; nothing can be evicted now."""


class SlotPool:
    """Fixed-size slots over one preallocated buffer.

    Args:
        capacity_bytes: size of the buffer.
        slot_bytes: slot size; ``None`` fixes it at the first :meth:`allocate`.
        prefault: write every page now (slower start, no page faults on the hot path).
        buffer: memory to use (e.g. a shared-memory segment, kvstore/shm.py), at least
            ``capacity_bytes`` long; default: a private zeroed array.

    Raises:
        ValueError: capacity or slot size < 1.
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int | None = None,
                 prefault: bool = False, buffer: np.ndarray | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if slot_bytes is not None and slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes}")
        self.capacity_bytes = capacity_bytes
        if buffer is not None and (buffer.dtype != np.uint8 or buffer.size < capacity_bytes):
            raise ValueError(f"buffer must be uint8 of >= {capacity_bytes} bytes")
        # NOTE: np.zeros (and a fresh segment) map pages lazily; prefault touches them once.
        self.buffer = (np.zeros(capacity_bytes, dtype=np.uint8) if buffer is None
                       else buffer[:capacity_bytes])
        if prefault:
            self.buffer[::4096] = 1  # NOTE: a write of a non-zero byte faults the page in
            self.buffer[::4096] = 0
        self.slot_bytes: int | None = None
        self.num_slots = 0
        self._free: list[int] = []
        self.entries: dict[str, Entry] = {}
        # committed, unpinned-or-pinned entries in LRU order (oldest first)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self.num_evictions = 0
        self._num_ttl = 0  # entries with a TTL
        self._used_bytes = 0
        if slot_bytes is not None:
            self._format(slot_bytes)

    def _format(self, slot_bytes: int) -> None:
        if slot_bytes > self.capacity_bytes:
            raise ValueError(
                f"block of {slot_bytes} bytes is larger than the node capacity "
                f"{self.capacity_bytes} bytes"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = self.capacity_bytes // slot_bytes
        # a min-heap: a batch gets ascending, mostly consecutive slots, so runs of
        # blocks move as one message (protocol.group_messages)
        self._free = list(range(self.num_slots))

    # -- views ------------------------------------------------------------------------------

    def view(self, slot: int, size_bytes: int) -> np.ndarray:
        """Writable uint8 view of the first ``size_bytes`` of ``slot`` (no copy)."""
        assert self.slot_bytes is not None and 0 <= slot < self.num_slots, f"bad slot {slot}"
        start = slot * self.slot_bytes
        return self.buffer[start : start + size_bytes]

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot`` in :attr:`buffer`."""
        assert self.slot_bytes is not None and 0 <= slot < self.num_slots, f"bad slot {slot}"
        return slot * self.slot_bytes

    def span(self, first_slot: int, num_slots: int, last_size_bytes: int) -> np.ndarray:
        """View over consecutive slots: all of each but the last, ``last_size_bytes`` of it."""
        assert self.slot_bytes is not None and first_slot + num_slots <= self.num_slots
        start = first_slot * self.slot_bytes
        return self.buffer[start : start + (num_slots - 1) * self.slot_bytes + last_size_bytes]

    @property
    def used_bytes(self) -> int:
        """Payload bytes of committed blocks."""
        return self._used_bytes

    @property
    def num_blocks(self) -> int:
        """Committed blocks."""
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    # -- lifecycle --------------------------------------------------------------------------

    def check_size(self, size_bytes: int) -> None:
        """Raise ValueError when a block of ``size_bytes`` cannot fit a slot."""
        if size_bytes < 1:
            raise ValueError(f"block size must be >= 1 byte, got {size_bytes}")
        if size_bytes > self.capacity_bytes:
            raise ValueError(
                f"block of {size_bytes} bytes is larger than the node capacity "
                f"{self.capacity_bytes} bytes"
            )
        if self.slot_bytes is not None and size_bytes > self.slot_bytes:
            raise ValueError(
                f"block of {size_bytes} bytes does not fit this node's {self.slot_bytes}-byte "
                "slots (wrong block size for this store node)"
            )

    def allocate(self, key: str, size_bytes: int, checksum: str,
                 ttl_s: float | None) -> tuple[Entry, list[Entry]]:
        """Reserve a slot for a pending write of ``key``; evict LRU blocks if needed.

        The new entry is pinned and uncommitted (invisible to reads) until
        :meth:`commit`. Returns ``(entry, evicted)``; the caller removes the
        evicted blocks' index entries in the same atomic update as the commit.

        Raises:
            ValueError: size does not fit (see :meth:`check_size`).
            PoolFullError: every slot is pinned.
        """
        self.check_size(size_bytes)
        if self.slot_bytes is None:
            self._format(size_bytes)
        evicted: list[Entry] = []
        old = self.entries.get(key)
        if old is not None and old.pins == 0:
            # NOTE: a re-put replaces the block (its index entry is rewritten by the commit).
            self._drop(old)
        elif old is not None:
            raise PoolFullError(f"block {key} is being read or written; retry")
        if not self._free:
            victim = self._pick_victim()
            if victim is None:
                raise PoolFullError("every slot is pinned by an in-flight transfer")
            self._drop(victim)
            self.num_evictions += 1
            evicted.append(victim)
        slot = heapq.heappop(self._free)
        expires = time.monotonic() + ttl_s if ttl_s else None
        entry = Entry(key, slot, size_bytes, checksum, expires, pins=1)
        self.entries[key] = entry
        self._num_ttl += expires is not None
        return entry, evicted

    def _pick_victim(self) -> Entry | None:
        now = time.monotonic()
        # expired blocks go first (scanned only when some block has a TTL), then
        # the least recently used unpinned one
        if self._num_ttl:
            for key in self._lru:
                e = self.entries[key]
                if e.pins == 0 and e.expires_at is not None and e.expires_at <= now:
                    return e
        for key in self._lru:
            e = self.entries[key]
            if e.pins == 0:
                return e
        return None

    def _drop(self, entry: Entry) -> None:
        self._num_ttl -= entry.expires_at is not None
        if entry.committed:
            self._used_bytes -= entry.size_bytes
        del self.entries[entry.key]
        self._lru.pop(entry.key, None)
        heapq.heappush(self._free, entry.slot)

    def commit(self, entry: Entry) -> None:
        """Mark a pending write complete: unpin it and make it the most recently used."""
        entry.pins -= 1
        entry.committed = True
        self._used_bytes += entry.size_bytes
        self._lru[entry.key] = None
        self._lru.move_to_end(entry.key)

    def abort(self, entry: Entry) -> None:
        """Give back the slot of a failed pending write."""
        if self.entries.get(entry.key) is entry:
            self._drop(entry)

    def acquire(self, key: str) -> Entry | None:
        """Pin ``key`` for a read and mark it used; ``None`` on a miss (absent, pending,
        or expired: an expired block is dropped and reported back by :meth:`expire`)."""
        e = self.entries.get(key)
        if e is None or not e.committed:
            return None
        if e.expires_at is not None and e.expires_at <= time.monotonic():
            return None
        e.pins += 1
        self._lru.move_to_end(key)
        return e

    def release(self, entry: Entry) -> None:
        """Unpin after a read finished (or failed)."""
        assert entry.pins > 0, f"release of unpinned block {entry.key}"
        entry.pins -= 1

    def expire(self) -> list[Entry]:
        """Drop every unpinned block whose TTL has passed; returns them (index cleanup)."""
        if not self._num_ttl:
            return []
        now = time.monotonic()
        gone = []
        for k in self._lru:
            e = self.entries[k]
            if e.pins == 0 and e.expires_at is not None and e.expires_at <= now:
                gone.append(e)
        for e in gone:
            self._drop(e)
        return gone

    def lru_keys(self) -> list[str]:
        """Committed keys, least recently used first (tests assert eviction order)."""
        return list(self._lru)
