"""Per-request block tables on top of the block pool, with hash-chained prefix caching.

The scheduler talks to this class only; it never touches the free queue. The
shape follows vLLM v1 ``vllm/v1/core/kv_cache_manager.py`` (single attention
type, full attention only), written anew.

Token ``t`` of a request lives in block ``block_table[t // block_size]`` at
offset ``t % block_size``; its slot is ``block_id * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.contracts.block_hash import BlockHash, hash_block
from tandem.contracts.kv_events import KVCacheEvent
from tandem.engine.block_pool import BlockPool, KVCacheBlock
from tandem.engine.request import Request


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheBlocks:
    """An allocation handed to the scheduler: blocks in block-table order.

    A value object (the pool's free lists never leave the pool). ``blocks`` are
    the pool's block objects so that ref counts stay exact; callers only read
    ``block_id``.
    """

    blocks: tuple[KVCacheBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(self.blocks + other.blocks)


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens.

    Attributes:
        num_requests: admissions that looked up the cache.
        queries: tokens looked up (each admission counts the request's ``num_tokens``).
        hits: tokens served from the cache.
    """

    num_requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables of running requests and the prefix cache.

    Args:
        num_blocks: blocks in the KV cache tensor.
        block_size: tokens per block.
        enable_caching: reuse cached full blocks across requests.

    Invariants: a request's table covers at least its computed tokens; every
    block in a table has ``ref_cnt >= 1``; a cached block's KV is computed (or
    being computed in the current step).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Chain hashes of each request's full blocks, extended incrementally as
        # tokens arrive; kept across preemption (the tokens do not change).
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # How many leading blocks of each table are registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- queries -----------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.block_pool.usage

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self.req_to_blocks

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's block table (empty when it holds none)."""
        return KVCacheBlocks(tuple(self.req_to_blocks.get(request_id, ())))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (empty when it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_block_hashes(self, request: Request) -> list[BlockHash]:
        """Chain hashes of the request's full blocks (prompt and output tokens so far).

        Computed incrementally and cached per request, the first one salted with the
        request's ``cache_salt``; ``hash_block`` (SHA-256 chain) makes them equal
        across processes, so the KV store and router can
        compare them. The returned list is the manager's; do not mutate it.
        """
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), len(tokens) // bs):
            if hashes:
                hashes.append(hash_block(hashes[-1], tokens[i * bs : (i + 1) * bs]))
            else:
                hashes.append(hash_block(None, tokens[:bs], cache_salt=request.cache_salt))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a request that holds no blocks yet.

        Only full blocks count, and never the whole sequence: at least one token
        is left to compute so that the step produces a sample (vLLM recomputes
        the last token the same way).

        A request asking for prompt logprobs gets no hit (vLLM's rule): a cached
        position has no logits, so its prompt is recomputed.

        Returns:
            (cached blocks in order, number of tokens they cover). Mutates no ref
            count: pass the blocks to ``allocate_slots`` to take them.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in self.get_block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return KVCacheBlocks(tuple(hit)), len(hit) * self.block_size

    def record_prefix_cache_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup (called once the request is admitted)."""
        if not self.enable_caching:
            return
        self.prefix_cache_stats.num_requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens

    # -- mutations ---------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        *,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Grow the request's table to hold its computed tokens plus ``num_new_tokens``.

        Tokens ``[0, request.num_computed_tokens + num_new_computed_tokens)`` are
        already computed; ``num_new_tokens`` more are about to be computed (or
        loaded from remote KV). Full blocks among them are registered in the
        prefix cache right away (vLLM does the same): the model runner writes a
        layer's K/V before that layer's attention reads the cache, so a request
        scheduled in the same step may already reuse them.

        Args:
            request: the request; ``request.num_computed_tokens`` is not changed.
            num_new_tokens: tokens to compute (or load) this step, >= 0.
            num_new_computed_tokens: prefix-cache hit tokens from
                ``get_computed_blocks`` (only for a request without blocks).
            new_computed_blocks: the hit blocks from ``get_computed_blocks``.
            delay_cache_blocks: do not register new full blocks (their KV is
                loaded asynchronously; call ``cache_blocks`` once it landed).

        Returns:
            The newly allocated blocks (possibly empty), or ``None`` when the
            pool has too few free blocks; then nothing was changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        req_id = request.request_id
        table = self.req_to_blocks.get(req_id)
        assert not computed or not table, f"{req_id}: prefix hits for a request holding blocks"
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_held = (len(table) if table else 0) + len(computed)
        num_to_allocate = max(0, num_required - num_held)
        # Hits sitting in the free queue stop being allocatable once touched.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_to_allocate > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if table is None:
            table = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = len(computed)
        if computed:
            self.block_pool.touch(computed)
            table.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate) if num_to_allocate else []
        table.extend(new_blocks)

        if not delay_cache_blocks:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks within ``num_computed_tokens`` tokens."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        table = self.req_to_blocks.get(req_id)
        if not table:
            return
        num_tokens = min(num_computed_tokens, request.num_tokens)
        num_full = min(num_tokens // self.block_size, len(table))
        num_cached = self.num_cached_block.get(req_id, 0)
        if num_full <= num_cached:
            return
        hashes = self.get_block_hashes(request)
        self.block_pool.cache_full_blocks(table, hashes, num_cached, num_full)
        self.num_cached_block[req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (finish, abort or preemption). Idempotent.

        Blocks go back in reverse table order so the sequence's tail is evicted
        before its (more shareable) head. Blocks registered at allocation whose
        KV was never computed (the request was preempted or aborted inside the
        step that allocated them) are dropped from the prefix cache, judged by
        ``request.num_computed_tokens``. A finished request's hashes are dropped;
        a preempted one keeps them for its resume.
        """
        req_id = request.request_id
        table = self.req_to_blocks.pop(req_id, None)
        self.num_cached_block.pop(req_id, None)
        if request.is_finished():
            self.req_to_block_hashes.pop(req_id, None)
        if table is None:
            return
        if self.enable_caching:
            num_valid = request.num_computed_tokens // self.block_size
            for block in table[num_valid:]:
                if block.ref_cnt == 1 and block.block_hash is not None:
                    self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; False (and nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    # -- KV events ---------------------------------------------------------

    def enable_kv_cache_events(self, medium: str) -> None:
        """Record the prefix cache's changes from now on, naming ``medium`` ("gpu" or
        "cpu"); called once, before the first block is cached (so that replaying the
        events from the start gives the cache).

        Raises:
            ValueError: naming ``medium`` when it is neither "gpu" nor "cpu".
        """
        if medium not in ("gpu", "cpu"):
            raise ValueError(f"medium must be 'gpu' or 'cpu', got {medium!r}")
        pool = self.block_pool
        assert pool.num_cached_blocks == 0, "KV events enabled after blocks were cached"
        pool.enable_kv_cache_events, pool.medium, pool.block_size = True, medium, self.block_size

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache events since the last call (``BlockPool.take_events``)."""
        return self.block_pool.take_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix cache (for a KV-events snapshot)."""
        return self.block_pool.cached_block_hashes()
