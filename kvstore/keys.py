"""Content-addressed keys of KV blocks: the engine's block hash plus a layout fingerprint.

A block's bytes only mean something to an engine with the same model and KV
layout, so the store key pairs the prefix-chain ``BlockHash``
(engine/block_hash.py, SHA-256 chain) with a digest of that layout. Two models,
dtypes, block sizes or tensor-parallel shards can never read each other's
blocks: their keys differ.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any

from tandem.engine.block_hash import BlockHash

#: Bytes per element of the KV cache dtypes the engine supports.
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Redis key prefix of block index entries (see kvstore/index.py).
INDEX_PREFIX = "tandem:kv:blk:"

#: Length of a layout digest in bytes.
FINGERPRINT_BYTES = 16


@dataclass(frozen=True)
class LayoutFingerprint:
    """What a KV block's bytes mean; two engines may share blocks only if equal.

    Attributes:
        model_id: the model's identifier (path or name).
        num_layers: transformer layers (a block holds all of them).
        num_kv_heads: KV heads per layer (of this tensor-parallel shard).
        head_dim: size of one head.
        dtype: torch dtype name of the cache: "float32", "bfloat16" or "float16".
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

    @classmethod
    def from_layout(cls, layout: Any, tp_rank: int = 0, tp_size: int = 1) -> LayoutFingerprint:
        """Build from the engine's ``KVCacheLayout`` (or any object with the same fields)."""
        return cls(
            model_id=str(layout.model_id),
            num_layers=int(layout.num_layers),
            num_kv_heads=int(layout.num_kv_heads),
            head_dim=int(layout.head_dim),
            dtype=str(layout.dtype).removeprefix("torch."),
            block_size=int(layout.block_size),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: ``num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize``
        (the contiguous ``kv_cache[b]`` of the engine's cache tensor)."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
            * DTYPE_ITEMSIZE[self.dtype]
        )

    @property
    def digest(self) -> bytes:
        """16-byte SHA-256 prefix of the canonical ``name=value|...`` field string.

        NOTE: the tensor-parallel fields enter the string only when ``tp_size > 1``
        so that the digest of an unsharded layout equals the engine's own
        ``KVCacheLayout.fingerprint`` (same fields, same order): one key spec.
        """
        names = [f.name for f in fields(self)]
        if self.tp_size == 1:
            names = [n for n in names if n not in ("tp_rank", "tp_size")]
        canon = "|".join(f"{n}={getattr(self, n)}" for n in names)
        return hashlib.sha256(canon.encode()).digest()[:FINGERPRINT_BYTES]

    def key(self, block_hash: bytes) -> BlockKey:
        """The store key of ``block_hash`` under this layout."""
        return BlockKey(BlockHash(bytes(block_hash)), self.digest)

    def keys(self, block_hashes: list[bytes] | list[BlockHash]) -> list[BlockKey]:
        """:meth:`key` of each hash, in order."""
        digest = self.digest
        return [BlockKey(BlockHash(bytes(h)), digest) for h in block_hashes]


@dataclass(frozen=True)
class BlockKey:
    """Store key of one KV block.

    Attributes:
        hash: the block's prefix-chain hash (32 bytes from ``hash_block``).
        layout_fingerprint: the layout digest (``LayoutFingerprint.digest`` or the
            engine's ``KVCacheLayout.fingerprint``).

    Raises:
        ValueError: empty hash or fingerprint, or not bytes.
    """

    hash: bytes
    layout_fingerprint: bytes

    def __post_init__(self) -> None:
        for name in ("hash", "layout_fingerprint"):
            value = getattr(self, name)
            if not isinstance(value, bytes | bytearray | memoryview):
                raise ValueError(f"BlockKey.{name} must be bytes, got {type(value).__name__}")
            if len(value) == 0:
                raise ValueError(f"BlockKey.{name} must not be empty")
            if not isinstance(value, bytes):
                object.__setattr__(self, name, bytes(value))

    def __str__(self) -> str:
        """``<fingerprint hex>:<hash hex>``: the stable string form (see :meth:`from_str`)."""
        return f"{self.layout_fingerprint.hex()}:{self.hash.hex()}"

    def to_bytes(self) -> bytes:
        """Length-prefixed binary form: ``len(fp) | fp | hash``."""
        return bytes([len(self.layout_fingerprint)]) + self.layout_fingerprint + self.hash

    @classmethod
    def from_bytes(cls, data: bytes) -> BlockKey:
        """Inverse of :meth:`to_bytes`. Raises ValueError on a malformed input."""
        if len(data) < 2 or data[0] == 0 or len(data) <= 1 + data[0]:
            raise ValueError("key bytes malformed")
        n = data[0]
        return cls(bytes(data[1 + n :]), bytes(data[1 : 1 + n]))

    @classmethod
    def from_str(cls, text: str) -> BlockKey:
        """Inverse of ``str(key)``. Raises ValueError on a malformed input."""
        fp, sep, h = text.partition(":")
        if not sep:
            raise ValueError(f"key string must be '<fingerprint hex>:<hash hex>', got {text!r}")
        try:
            return cls(bytes.fromhex(h), bytes.fromhex(fp))
        except ValueError as exc:
            raise ValueError(f"key string is not hex: {text!r}") from exc

    @property
    def redis_key(self) -> str:
        """The Redis key of this block's index entry."""
        return INDEX_PREFIX + str(self)
