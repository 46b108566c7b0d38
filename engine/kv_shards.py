"""An engine's KV cache split over tensor/pipeline-parallel ranks, read and written as
whole blocks of the full model.

With tensor parallelism each rank caches a range of KV heads (when ``num_kv_heads <
tp_size`` several ranks hold the same head: replicas); with pipeline parallelism each
stage caches a contiguous range of layers. Each rank's cache is one shard::

    tensor [num_blocks, n_local_layers, 2, block_size, n_local_kv_heads, head_dim]

holding ``layer_range`` x ``head_range`` of the full block
``[num_layers, 2, block_size, num_kv_heads, head_dim]``.

The KV store keeps blocks in that canonical full-head layout (the full model's
``KVCacheLayout``), so engines at any TP/PP share keys: a save assembles full blocks
from the shards (:meth:`ShardedKVCache.read_blocks`), a load scatters full blocks into
every shard holding a part (:meth:`ShardedKVCache.write_blocks`, replicas included). An
unsharded cache is the one-shard case (:meth:`ShardedKVCache.from_tensor`).

The head split follows vLLM's (``num_kv_head_replicas = tp_size // num_kv_heads`` when
``num_kv_heads < tp_size``): :func:`kv_head_range`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShard:
    """One rank's part of the KV cache.

    Attributes:
        tensor: ``[num_blocks, len(layer_range), 2, block_size, len(head_range),
            head_dim]``, any device; block ``b`` of the full cache is ``tensor[b]``'s part.
        layer_range: the full model's layers it holds (step 1, non-empty).
        head_range: the full model's KV heads it holds (step 1, non-empty).
    """

    tensor: torch.Tensor
    layer_range: range
    head_range: range


@dataclass(frozen=True)
class _Piece:
    """A box of the full block read from one shard: full layers ``layers`` and heads
    ``heads`` are the shard's local ``layers - layer_range.start`` etc."""

    shard: int
    layers: slice  # of the full block
    heads: slice
    local_layers: slice  # of the shard's block
    local_heads: slice


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first block id, length)`` of each run of consecutive ascending ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


class ShardedKVCache:
    """The KV cache as shards, read and written as full blocks.

    Args:
        shards: every rank's shard (replicas included; order picks which replica a read
            uses: the first holding a head).
        num_layers, num_kv_heads: the full model's; default the largest range stop.

    Raises:
        ValueError: no shard; a tensor not 6-d or not 1 or 2 in dim 2; dims of a tensor
            not matching its ranges; ``num_blocks``, ``block_size``, ``head_dim`` or dtype
            differing between shards; a range empty, of step != 1, negative or past the
            full model; a (layer, head) of the full block that no shard holds. The
            message names the shard and field.
    """

    def __init__(self, shards: Sequence[KVShard], *, num_layers: int | None = None,
                 num_kv_heads: int | None = None) -> None:
        shards = list(shards)
        if not shards:
            raise ValueError("shards must hold at least one shard")
        ref = shards[0].tensor
        for i, s in enumerate(shards):
            t = s.tensor
            # dim 2: K and V (2), or an MLA model's latent entry (1)
            if t.dim() != 6 or t.shape[2] not in (1, 2):
                raise ValueError(
                    f"shards[{i}].tensor must be [num_blocks, layers, 2 (or 1), block_size, "
                    f"heads, head_dim], got shape {tuple(t.shape)}")
            for name, r, dim in (("layer_range", s.layer_range, 1),
                                 ("head_range", s.head_range, 4)):
                if r.step != 1 or len(r) == 0 or r.start < 0:
                    raise ValueError(
                        f"shards[{i}].{name} must be a non-empty range of step 1 from >= 0, "
                        f"got {r}")
                if t.shape[dim] != len(r):
                    raise ValueError(
                        f"shards[{i}].tensor has {t.shape[dim]} in dim {dim}, its {name} "
                        f"{r} has {len(r)}")
            for name, dim in (("num_blocks", 0), ("components", 2), ("block_size", 3),
                              ("head_dim", 5)):
                if t.shape[dim] != ref.shape[dim]:
                    raise ValueError(
                        f"shards[{i}] has {name}={t.shape[dim]}, shards[0] has {ref.shape[dim]}")
            if t.dtype != ref.dtype:
                raise ValueError(f"shards[{i}] has dtype {t.dtype}, shards[0] has {ref.dtype}")
        n_layers = max(s.layer_range.stop for s in shards) if num_layers is None else num_layers
        n_heads = (max(s.head_range.stop for s in shards) if num_kv_heads is None
                   else num_kv_heads)
        for i, s in enumerate(shards):
            if s.layer_range.stop > n_layers:
                raise ValueError(
                    f"shards[{i}].layer_range {s.layer_range} is past num_layers={n_layers}")
            if s.head_range.stop > n_heads:
                raise ValueError(
                    f"shards[{i}].head_range {s.head_range} is past num_kv_heads={n_heads}")
        self.shards: tuple[KVShard, ...] = tuple(shards)
        self.num_blocks: int = int(ref.shape[0])
        self.dtype: torch.dtype = ref.dtype
        #: ``(num_layers, 2 or 1, block_size, num_kv_heads, head_dim)`` of a full block
        self.block_shape: tuple[int, int, int, int, int] = (
            n_layers, int(ref.shape[2]), int(ref.shape[3]), n_heads, int(ref.shape[5]))
        self._pieces = self._plan_reads()

    @classmethod
    def from_tensor(cls, kv_cache: torch.Tensor) -> ShardedKVCache:
        """The one-shard cache of an unsharded ``kv_cache`` ``[num_blocks, num_layers, 2,
        block_size, num_kv_heads, head_dim]``.

        Raises:
            ValueError: ``kv_cache`` is not 6-d with 2 in dim 2.
        """
        if kv_cache.dim() != 6:
            raise ValueError(f"kv_cache must be 6-d, got shape {tuple(kv_cache.shape)}")
        return cls([KVShard(kv_cache, range(kv_cache.shape[1]), range(kv_cache.shape[4]))])

    @property
    def is_single(self) -> bool:
        """One shard holding the whole block: ``shards[0].tensor[b]`` is block ``b``."""
        s = self.shards[0]
        return (len(self.shards) == 1 and len(s.layer_range) == self.block_shape[0]
                and len(s.head_range) == self.block_shape[3])

    @property
    def block_bytes(self) -> int:
        """Bytes of one full block."""
        n = self.dtype.itemsize
        for d in self.block_shape:
            n *= d
        return n

    def _plan_reads(self) -> list[_Piece]:
        """Boxes covering the full block once each, read from the first shard holding them.

        The layer and head axes are cut at every range boundary; each cell lies inside
        or outside each shard, so the first shard holding a cell reads it; cells of one
        shard adjacent in heads, then in layers, merge (a TP x PP grid: one box per shard
        that is not a replica).

        Raises:
            ValueError: a (layer, head) no shard holds.
        """
        n_layers, _, _, n_heads, _ = self.block_shape
        lcuts = sorted({0, n_layers, *(x for s in self.shards
                                       for x in (s.layer_range.start, s.layer_range.stop))})
        hcuts = sorted({0, n_heads, *(x for s in self.shards
                                      for x in (s.head_range.start, s.head_range.stop))})
        # per layer band: [(shard, h0, h1)] merged along heads
        bands: list[tuple[int, int, list[tuple[int, int, int]]]] = []
        for l0, l1 in zip(lcuts, lcuts[1:], strict=False):
            row: list[tuple[int, int, int]] = []
            for h0, h1 in zip(hcuts, hcuts[1:], strict=False):
                owner = next((i for i, s in enumerate(self.shards)
                              if s.layer_range.start <= l0 and l1 <= s.layer_range.stop
                              and s.head_range.start <= h0 and h1 <= s.head_range.stop), None)
                if owner is None:
                    raise ValueError(
                        f"no shard holds layers {l0}..{l1 - 1} x KV heads {h0}..{h1 - 1} of "
                        f"the full block (num_layers={n_layers}, num_kv_heads={n_heads})")
                if row and row[-1][0] == owner and row[-1][2] == h0:
                    row[-1] = (owner, row[-1][1], h1)
                else:
                    row.append((owner, h0, h1))
            if bands and bands[-1][2] == row and bands[-1][1] == l0:
                bands[-1] = (bands[-1][0], l1, row)
            else:
                bands.append((l0, l1, row))
        pieces = []
        for l0, l1, row in bands:
            for owner, h0, h1 in row:
                s = self.shards[owner]
                ls, hs = s.layer_range.start, s.head_range.start
                pieces.append(_Piece(owner, slice(l0, l1), slice(h0, h1),
                                     slice(l0 - ls, l1 - ls), slice(h0 - hs, h1 - hs)))
        return pieces

    def _check_ids(self, block_ids: Sequence[int], buf: torch.Tensor, name: str) -> None:
        if tuple(buf.shape) != (len(block_ids), *self.block_shape):
            raise ValueError(
                f"{name} must be [{len(block_ids)}, {', '.join(map(str, self.block_shape))}], "
                f"got shape {tuple(buf.shape)}")
        if buf.dtype != self.dtype:
            raise ValueError(f"{name} must have dtype {self.dtype}, got {buf.dtype}")
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} is outside [0, num_blocks={self.num_blocks})")

    def read_blocks(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Assemble full blocks: ``out[i] = block block_ids[i]``; each replicated head is
        read from one shard. Blocks until the copies are done.

        Args:
            block_ids: cache block ids (runs of consecutive ids move in one copy per piece).
            out: ``[len(block_ids), *block_shape]`` of the cache's dtype, any device
                (host staging buffers for the store).

        Raises:
            ValueError: ``out`` of another shape or dtype, or a block id out of range.
        """
        self._check_ids(block_ids, out, "out")
        for pos, first, n in _runs(block_ids):
            dst = out[pos:pos + n]
            for p in self._pieces:
                src = self.shards[p.shard].tensor[first:first + n]
                dst[:, p.layers, :, :, p.heads].copy_(src[:, p.local_layers, :, :, p.local_heads])

    def write_blocks(self, block_ids: Sequence[int], src: torch.Tensor) -> None:
        """Scatter full blocks: block ``block_ids[i] = src[i]``, into every shard holding
        each part (replicas included). Blocks until the copies are done.

        Args:
            block_ids: cache block ids, each at most once.
            src: ``[len(block_ids), *block_shape]`` of the cache's dtype, any device.

        Raises:
            ValueError: ``src`` of another shape or dtype, or a block id out of range.
        """
        self._check_ids(block_ids, src, "src")
        for pos, first, n in _runs(block_ids):
            part = src[pos:pos + n]
            for s in self.shards:
                lr, hr = s.layer_range, s.head_range
                s.tensor[first:first + n].copy_(
                    part[:, lr.start:lr.stop, :, :, hr.start:hr.stop])

    def read_block(self, block_id: int, out: torch.Tensor) -> None:
        """:meth:`read_blocks` of one block into ``out`` ``[*block_shape]``."""
        self.read_blocks([block_id], out.unsqueeze(0))

    def write_block(self, block_id: int, src: torch.Tensor) -> None:
        """:meth:`write_blocks` of one block from ``src`` ``[*block_shape]``."""
        self.write_blocks([block_id], src.unsqueeze(0))

    def __repr__(self) -> str:
        parts = ", ".join(f"layers {s.layer_range.start}..{s.layer_range.stop - 1} x heads "
                          f"{s.head_range.start}..{s.head_range.stop - 1}" for s in self.shards)
        return f"ShardedKVCache(num_blocks={self.num_blocks}, block_shape={self.block_shape}, " \
               f"shards=[{parts}])"
