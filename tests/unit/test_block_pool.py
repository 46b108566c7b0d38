"""Block pool: free queue in LRU eviction order, ref counts, the prefix-cache map."""

from __future__ import annotations

import pytest

from tandem.contracts.block_hash import hash_block
from tandem.engine.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_initial_state_all_free_in_id_order() -> None:
    pool = BlockPool(num_blocks=5)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_get_new_blocks_takes_from_head_with_ref_cnt_one() -> None:
    pool = BlockPool(num_blocks=5)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert free_ids(pool) == [3, 4]
    assert pool.usage == pytest.approx(0.6)


def test_get_new_blocks_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [2]


def test_freed_blocks_go_to_tail_in_given_order() -> None:
    pool = BlockPool(num_blocks=6)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))  # a request frees its table reversed
    assert free_ids(pool) == [5, 2, 1, 0]
    pool.free_blocks(reversed(b))
    assert free_ids(pool) == [5, 2, 1, 0, 4, 3]
    # Eviction takes the least recently freed first, and a sequence's tail first.
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [5, 2, 1]


def test_shared_block_returns_to_queue_only_at_ref_cnt_zero() -> None:
    pool = BlockPool(num_blocks=4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and 0 not in free_ids(pool)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and free_ids(pool) == [1, 2, 3, 0]


def test_double_free_is_caught() -> None:
    pool = BlockPool(num_blocks=2)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blk])


def test_cache_full_blocks_and_lookup() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    h0 = hash_block(None, list(range(4)))
    h1 = hash_block(h0, list(range(4, 8)))
    pool.cache_full_blocks(blocks, [h0, h1], num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(h0) is blocks[0]
    assert pool.get_cached_block(h1) is blocks[1]
    assert blocks[2].block_hash is None
    assert pool.num_cached_blocks == 2
    # A miss is a value.
    assert pool.get_cached_block(hash_block(None, [9, 9, 9, 9])) is None


def test_touch_revives_a_free_cached_block_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    h = [hash_block(None, [i] * 4) for i in range(3)]
    pool.cache_full_blocks(blocks, h, 0, 3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1, 0]
    hit = pool.get_cached_block(h[1])
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_ids(pool) == [3, 2, 0]
    assert pool.get_cached_block(h[1]) is hit  # still cached while in use


def test_eviction_drops_the_hash_from_the_cache() -> None:
    pool = BlockPool(num_blocks=2)
    blocks = pool.get_new_blocks(2)
    h = [hash_block(None, [i] * 4) for i in range(2)]
    pool.cache_full_blocks(blocks, h, 0, 2)
    pool.free_blocks(reversed(blocks))  # queue: 1, 0
    (reused,) = pool.get_new_blocks(1)
    assert reused.block_id == 1 and reused.block_hash is None
    assert pool.get_cached_block(h[1]) is None
    assert pool.get_cached_block(h[0]) is blocks[0]  # not evicted yet


def test_duplicate_content_is_not_registered_twice() -> None:
    pool = BlockPool(num_blocks=2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    # Evicting the uncached duplicate must not drop the real entry.
    pool.free_blocks([b])
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is a


def test_uncache_and_reset_prefix_cache() -> None:
    pool = BlockPool(num_blocks=3)
    blocks = pool.get_new_blocks(2)
    h = [hash_block(None, [i] * 4) for i in range(2)]
    pool.cache_full_blocks(blocks, h, 0, 2)
    pool.uncache_block(blocks[0])
    assert pool.get_cached_block(h[0]) is None and blocks[0].block_hash is None
    assert pool.reset_prefix_cache() is False  # blocks in use
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    h = hash_block(None, [1])
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert pool.get_cached_block(h) is None and pool.num_cached_blocks == 0


def test_free_queue_remove_and_append_keep_links_consistent() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3]
    q.append(blocks[0])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 3, 0]
    assert q.num_free_blocks == 3
    assert [q.popleft().block_id for _ in range(3)] == [1, 3, 0]
    with pytest.raises(ValueError):
        q.popleft()


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0)
