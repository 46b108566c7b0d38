"""Physical KV blocks: the free queue in eviction order and the prefix-cache map.

A block is one ``block_size``-token slice of the paged KV cache: block ``b`` is
``kv_cache[b]`` (all layers, K and V). The pool owns every block object; the
KV cache manager borrows them for requests through reference counts.

Design (after vLLM v1 ``vllm/v1/core/block_pool.py``, written anew):

* A block with ``ref_cnt == 0`` sits in the ``FreeKVCacheBlockQueue``; it may
  still hold a ``block_hash`` (its KV stays reusable until it is evicted).
* Freed blocks go to the tail of the queue and new blocks are taken from the
  head, so the least recently freed block is evicted first (LRU). The manager
  frees a request's blocks in reverse order, so the tail of a sequence is
  evicted before its head (the head is the part most likely shared).
* ``cached_block_hash_to_block`` maps a full block's chain hash to the block
  holding that KV. Taking a cached block from the free queue for new data
  (eviction) drops its hash from the map.
* With KV events on, every change of that map is recorded as a ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared`` event (``contracts.kv_events``), taken once
  per engine step by ``take_events`` (vLLM's ``BlockPool.kv_event_queue``): replaying
  them gives exactly the map's key set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)


class KVCacheBlock:
    """Metadata of one physical KV block.

    Attributes:
        block_id: index into the first dimension of the KV cache tensor.
        ref_cnt: number of requests using the block; 0 means it is in the free queue.
        block_hash: chain hash of the full block's tokens when the block is in
            the prefix cache, else ``None``.
        prev_free_block / next_free_block: links of the free queue (only
            meaningful while the block is free).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = evicted first).

    A linked list rather than a deque because a prefix-cache hit must remove a
    block from the middle of the queue in O(1) (``remove``). Two sentinel nodes
    avoid the empty-list branches.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next.

        Raises:
            ValueError: the queue is empty.
        """
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` (which must be in this queue) in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"{block} is already in the free queue"
        )
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Free blocks in eviction order (for tests and debugging; O(n))."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free_block
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free_block
        return out


class BlockPool:
    """All KV blocks of one engine, their free queue and the prefix-cache map.

    Args:
        num_blocks: number of blocks in the KV cache tensor (>= 1).
        enable_caching: keep hashes of full blocks for prefix reuse.
        enable_kv_cache_events: record the prefix cache's changes (``take_events``).
        medium: the medium the events name ("gpu" or "cpu": where the KV cache lives).
        block_size: tokens per block (what ``BlockStored`` events say).

    Not thread-safe: only the scheduler (one thread) calls it.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        *,
        enable_kv_cache_events: bool = False,
        medium: str = "gpu",
        block_size: int = 16,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        self._removed: list[BlockHash] = []  # evictions not yet in ``_events``
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # NOTE: one block per hash. When two requests compute the same block
        # concurrently, the second copy stays uncached and dies with its request.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    # -- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (cached or not): what ``get_new_blocks`` can hand out."""
        return self.free_block_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (used or free)."""
        return len(self.cached_block_hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (ref_cnt > 0), in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash``'s KV, or ``None`` on a miss. Mutates nothing."""
        return self.cached_block_hash_to_block.get(block_hash)

    # -- mutations ---------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, ref_cnt 1 each.

        A taken block that still holds a cached hash is evicted: its hash leaves
        the prefix cache.

        Raises:
            ValueError: fewer than ``num_blocks`` free blocks (callers check first).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0, f"{block} was free with a non-zero ref_cnt"
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail.

        Args:
            ordered_blocks: in eviction order (first = evicted first); the
                manager passes a request's blocks reversed.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        Args:
            blocks: a request's block table.
            block_hashes: the request's chain hashes (at least ``num_full_blocks``).
            num_cached_blocks: blocks of this table already registered.
            num_full_blocks: blocks of this table that are full (and computed, or
                being computed in the current step).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(block_hashes) >= num_full_blocks, (
            f"{len(block_hashes)} hashes for {num_full_blocks} full blocks"
        )
        run_start = -1  # index of the first block of the run of newly stored ones
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                # A prefix hit: already cached under this very hash.
                assert block.block_hash == block_hash, f"{block} re-cached under another hash"
                run_start = self._record_stored(block_hashes, run_start, i)
                continue
            if block_hash in self.cached_block_hash_to_block:
                # duplicate content computed concurrently; see NOTE in __init__
                run_start = self._record_stored(block_hashes, run_start, i)
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if run_start < 0:
                run_start = i
        self._record_stored(block_hashes, run_start, num_full_blocks)

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Drop ``block`` from the prefix cache (its KV is not valid, e.g. never computed)."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use.

        Returns:
            True if reset, False when some block is still in use.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            # NOTE: earlier events of this step are moot once everything is cleared.
            self._events, self._removed = [AllBlocksCleared(self.medium)], []
        return True

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache (a snapshot for KV events; O(cached blocks))."""
        return list(self.cached_block_hash_to_block)

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events recorded since the last call, in order (empty when
        events are off), and forget them."""
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def _record_stored(self, chain: Sequence[BlockHash], start: int, end: int) -> int:
        """Record ``chain[start:end]`` as one ``BlockStored`` (nothing when ``start`` < 0
        or events are off); returns -1 (no run open)."""
        if start < 0 or not self.enable_kv_cache_events:
            return -1
        self._flush_removed()
        parent = chain[start - 1] if start > 0 else None
        self._events.append(
            BlockStored(tuple(chain[start:end]), parent, self.block_size, self.medium)
        )
        return -1

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(tuple(self._removed), self.medium))
            self._removed = []

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
            if self.enable_kv_cache_events:
                # consecutive evictions (one allocation) travel as one event
                self._removed.append(block_hash)
        block.block_hash = None
