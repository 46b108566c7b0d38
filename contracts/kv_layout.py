"""The layout of a KV block and its fingerprint: what a block's bytes mean.

One class for engine, store and services alike: the engine describes its cache with it
(``EngineCore.layout``), the store checks block sizes with it, and its ``fingerprint``
goes into every store key (``BlockKey``) and into ``PrefillResponse`` /
``DecodeRequest.kv_layout_fingerprint``, so prefill and decode fail fast when their
layouts differ.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.block_key import BlockKey

#: Bytes per element of the KV cache dtypes the engine supports.
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Length of a layout fingerprint in bytes.
FINGERPRINT_BYTES = 16


@dataclass(frozen=True)
class KVCacheLayout:
    """What a KV block's bytes mean; two engines may share blocks only if equal.

    A block is ``kv_cache[b]`` of the engine's cache tensor
    ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: K and V of
    every layer, contiguous.

    Attributes:
        model_id: the model's identifier (path or name).
        num_layers: transformer layers (a block holds all of them).
        num_kv_heads: KV heads per layer (of this tensor-parallel shard).
        head_dim: size of one head.
        dtype: torch dtype name of the cache without ``torch.``: "float32",
            "bfloat16" or "float16".
        block_size: tokens per block.
        tp_rank: tensor-parallel rank whose shard the block holds.
        tp_size: tensor-parallel world size.

    Raises:
        ValueError: a field out of range (named in the message).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one block: ``num_layers * 2 * block_size * num_kv_heads * head_dim *
        itemsize``."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * DTYPE_ITEMSIZE[self.dtype]

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """``FINGERPRINT_BYTES`` bytes of SHA-256 over the canonical ``name=value|...``
        string of the fields, stable across processes and machines.

        NOTE: the tensor-parallel fields enter the string only when ``tp_size > 1``, so
        an unsharded layout keeps the fingerprint it had before those fields existed
        (blocks already in a store stay readable). Computed once per object: the store
        client compares it with every key.
        """
        names = [f.name for f in fields(self)]
        if self.tp_size == 1:
            names = [n for n in names if n not in ("tp_rank", "tp_size")]
        canon = "|".join(f"{n}={getattr(self, n)}" for n in names)
        return hashlib.sha256(canon.encode()).digest()[:FINGERPRINT_BYTES]

    def key(self, block_hash: bytes) -> BlockKey:
        """The store key of ``block_hash`` under this layout."""
        return BlockKey(BlockHash(bytes(block_hash)), self.fingerprint)

    def keys(self, block_hashes: Sequence[bytes]) -> list[BlockKey]:
        """:meth:`key` of each hash, in order."""
        fingerprint = self.fingerprint
        return [BlockKey(BlockHash(bytes(h)), fingerprint) for h in block_hashes]
