"""Per-rank KV cache shards cut from a full cache, as a TP x PP engine holds them (for the
ShardedKVCache and store connector tests)."""

from __future__ import annotations

import torch

from tandem.engine.distributed import kv_head_range
from tandem.engine.kv_shards import KVShard, ShardedKVCache


def split(full: torch.Tensor, tp: int, pp: int) -> ShardedKVCache:
    """Copies of ``full`` ``[num_blocks, L, 2, bs, H, hd]`` per rank: vLLM's head split
    (replicated when H < tp) times equal contiguous layer stages; ranks in stage-major
    order."""
    n_layers, n_heads = full.shape[1], full.shape[4]
    assert n_layers % pp == 0, "equal stages only"
    per_stage = n_layers // pp
    shards = []
    for stage in range(pp):
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        for rank in range(tp):
            heads = kv_head_range(rank, tp, n_heads)
            part = full[:, layers.start:layers.stop, :, :, heads.start:heads.stop]
            shards.append(KVShard(part.clone(), layers, heads))
    return ShardedKVCache(shards)


def assert_shards_hold(cache: ShardedKVCache, full: torch.Tensor) -> None:
    """Every shard (replicas included) holds its part of ``full``."""
    for i, s in enumerate(cache.shards):
        lr, hr = s.layer_range, s.head_range
        assert torch.equal(s.tensor, full[:, lr.start:lr.stop, :, :, hr.start:hr.stop]), \
            f"shard {i} (layers {lr}, heads {hr}) differs"
