"""ShardedKVCache (engine/kv_shards.py): full blocks read from and written to a KV
cache split by tensor-parallel head ranges and pipeline-parallel layer ranges."""

from __future__ import annotations

import pytest
import torch
from kv_shard_cases import assert_shards_hold, split

from tandem.engine.kv_shards import KVShard, ShardedKVCache

NUM_BLOCKS, BS, HD = 6, 4, 3


CASES = {  # name: (num_layers, num_kv_heads, tp, pp)
    "tp2": (2, 4, 2, 1),
    "tp2-one-kv-head-replicated": (2, 1, 2, 1),
    "tp4-two-kv-heads-replicated": (2, 2, 4, 1),
    "pp2": (4, 2, 1, 2),
    "tp2xpp2": (4, 4, 2, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_round_trip_against_a_full_tensor(case: str) -> None:
    n_layers, n_heads, tp, pp = CASES[case]
    full = torch.randn(NUM_BLOCKS, n_layers, 2, BS, n_heads, HD)
    cache = split(full, tp, pp)
    assert cache.block_shape == (n_layers, 2, BS, n_heads, HD)
    assert cache.num_blocks == NUM_BLOCKS and not cache.is_single

    # read: one block, then a batch mixing a run (1, 2, 3) with a lone block out of order
    out = torch.empty(cache.block_shape)
    cache.read_block(4, out)
    assert torch.equal(out, full[4])
    ids = [1, 2, 3, 0, 5]
    batch = torch.empty(len(ids), *cache.block_shape)
    cache.read_blocks(ids, batch)
    assert torch.equal(batch, full[ids])

    # write: every shard holding a part gets it, replicas included
    new = torch.randn(len(ids), *cache.block_shape)
    cache.write_blocks(ids, new)
    cache.write_block(4, -full[4])
    expect = full.clone()
    expect[ids] = new
    expect[4] = -full[4]
    assert_shards_hold(cache, expect)
    cache.read_blocks(list(range(NUM_BLOCKS)), batch := torch.empty(NUM_BLOCKS, *cache.block_shape))
    assert torch.equal(batch, expect)


def test_a_replicated_head_is_read_from_the_first_shard_holding_it() -> None:
    full = torch.randn(NUM_BLOCKS, 2, 2, BS, 1, HD)
    cache = split(full, 2, 1)
    cache.shards[1].tensor.fill_(float("nan"))  # a stale replica must not be read
    out = torch.empty(2, 2, BS, 1, HD)
    cache.read_block(3, out)
    assert torch.equal(out, full[3])


def test_one_tensor_is_the_single_shard_case() -> None:
    full = torch.randn(NUM_BLOCKS, 2, 2, BS, 2, HD)
    cache = ShardedKVCache.from_tensor(full)
    assert cache.is_single and cache.block_bytes == full[0].numel() * 4
    cache.write_block(2, torch.ones(cache.block_shape))
    assert torch.equal(full[2], torch.ones(cache.block_shape))  # in place, no copy kept


def test_bad_shards_are_rejected_naming_what_is_wrong() -> None:
    t = torch.zeros(NUM_BLOCKS, 2, 2, BS, 1, HD)
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedKVCache([])
    with pytest.raises(ValueError, match="no shard holds layers 0..1 x KV heads 1..1"):
        ShardedKVCache([KVShard(t, range(2), range(0, 1))], num_kv_heads=2)
    with pytest.raises(ValueError, match="no shard holds layers 2..3 x KV heads 0..0"):
        ShardedKVCache([KVShard(t, range(0, 2), range(1)), KVShard(t, range(4, 6), range(1))])
    with pytest.raises(ValueError, match=r"shards\[0\].tensor has 2 in dim 1, its layer_range"):
        ShardedKVCache([KVShard(t, range(3), range(1))])
    with pytest.raises(ValueError, match=r"shards\[0\].head_range must be a non-empty range"):
        ShardedKVCache([KVShard(t[:, :, :, :, :0], range(2), range(0))])
    with pytest.raises(ValueError, match=r"shards\[1\] has num_blocks=5"):
        ShardedKVCache([KVShard(t, range(2), range(1)), KVShard(t[:5], range(2), range(1, 2))])
    with pytest.raises(ValueError, match=r"shards\[1\] has dtype torch.float64"):
        ShardedKVCache([KVShard(t, range(2), range(1)),
                        KVShard(t.double(), range(2), range(1, 2))])
    with pytest.raises(ValueError, match=r"shards\[0\].tensor must be \[num_blocks"):
        ShardedKVCache([KVShard(t[0], range(2), range(1))])
    with pytest.raises(ValueError, match="past num_layers=1"):
        ShardedKVCache([KVShard(t, range(2), range(1))], num_layers=1)
    cache = ShardedKVCache.from_tensor(t)
    with pytest.raises(ValueError, match="out must be"):
        cache.read_blocks([0, 1], torch.empty(1, *cache.block_shape))
    with pytest.raises(ValueError, match="block id 6 is outside"):
        cache.write_blocks([6], torch.empty(1, *cache.block_shape))
    with pytest.raises(ValueError, match="src must have dtype"):
        cache.write_blocks([0], torch.empty(1, *cache.block_shape, dtype=torch.float64))
