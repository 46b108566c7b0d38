"""Store keys of KV blocks, and what a decode request says about its prompt's stored blocks.

A block's bytes only mean something to an engine with the same model and KV layout, so
the store key pairs the prefix-chain ``BlockHash`` (contracts/block_hash.py) with the
layout fingerprint (``KVCacheLayout.fingerprint``, contracts/kv_layout.py). Two models,
dtypes, block sizes or tensor-parallel shards can never read each other's blocks: their
keys differ.

The Redis index key of a block (:attr:`BlockKey.redis_key`) is part of the contract too:
store nodes write it and every client and router replica reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.contracts.block_hash import BLOCK_HASH_BYTES, BlockHash

#: Redis key prefix of block index entries (see kvstore/index.py).
INDEX_PREFIX = "tandem:kv:blk:"


@dataclass(frozen=True)
class BlockKey:
    """Store key of one KV block.

    Attributes:
        hash: the block's prefix-chain hash (``hash_block``'s 32 bytes).
        layout_fingerprint: ``KVCacheLayout.fingerprint`` of the engine that computed it.

    Raises:
        ValueError: empty hash or fingerprint, or not bytes (naming the field).
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
        """The Redis key of this block's index entry: ``INDEX_PREFIX + str(self)``."""
        return INDEX_PREFIX + str(self)


@dataclass(frozen=True)
class KVTransferParams:
    """Where a request's prompt KV lies in the store: the decode side's handoff from prefill.

    Set as ``Request.kv_transfer_params`` by the decode service from a ``DecodeRequest``
    (``block_hashes``, ``kv_layout_fingerprint``); a consumer connector loads those blocks
    when ``layout_fingerprint`` equals its own layout's, and ignores them otherwise.

    Attributes:
        block_hashes: the prompt's block hashes in order (``prompt_block_hashes``: full
            blocks, then the partial tail), ``BLOCK_HASH_BYTES`` each.
        layout_fingerprint: the producer's ``KVCacheLayout.fingerprint``.
        publish_pending: the producer answered before its publish of these blocks ended
            (``DecodeRequest.kv_publish_pending``): a block missing at load time may
            still arrive, so the consumer waits for it (bounded) before recomputing.

    Raises:
        ValueError: a hash of the wrong length (``block_hashes[i]``) or an empty
            fingerprint (``layout_fingerprint``).
    """

    block_hashes: tuple[BlockHash, ...]
    layout_fingerprint: bytes
    publish_pending: bool = False

    def __post_init__(self) -> None:
        for i, h in enumerate(self.block_hashes):
            if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
                size = len(h) if isinstance(h, bytes) else type(h).__name__
                raise ValueError(
                    f"block_hashes[{i}] has {size} bytes; block hashes are "
                    f"{BLOCK_HASH_BYTES} bytes (PrefillResponse.block_hashes)"
                )
        if not self.layout_fingerprint:
            raise ValueError("layout_fingerprint must not be empty")

    def keys(self) -> list[BlockKey]:
        """The store key of each block, in order."""
        return [BlockKey(h, self.layout_fingerprint) for h in self.block_hashes]


@dataclass(frozen=True)
class PublishInFlight:
    """A publish of some of a prompt's blocks that may still be running when it arrives.

    The router sets it on a prompt that continues the prompt + output of a request that
    just finished on a decode instance publishing its outputs (the next turn of a chat):
    that decode's publish of the answer's blocks runs after the answer streamed out, so
    the next turn can reach a store lookup before those blocks are in the index. A
    lookup that misses blocks in ``[first_block, end_block)`` then waits (bounded) for
    them or for the publish's end marker instead of recomputing them; ignoring it only
    costs that recompute, never a token.

    Attributes:
        request_id: the finished request whose output publish brings the blocks (its
            end marker is ``kvstore.index.output_marker_key(layout_fingerprint,
            request_id)``).
        layout_fingerprint: ``KVCacheLayout.fingerprint`` of the publishing engine; an
            engine of another layout ignores the hint.
        block_size: tokens per block of the indices below; an engine with another block
            size ignores the hint.
        first_block: index, in this prompt's full-block hash chain, of the first block the
            publish brings (blocks before it were in the store already).
        end_block: one past the last such block.

    Raises:
        ValueError: naming the field: an empty ``request_id`` or ``layout_fingerprint``,
            ``block_size < 1``, ``first_block < 0`` or ``end_block <= first_block``.
    """

    request_id: str
    layout_fingerprint: bytes
    block_size: int
    first_block: int
    end_block: int

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("kv_publish_in_flight.request_id must not be empty")
        if not self.layout_fingerprint:
            raise ValueError("kv_publish_in_flight.kv_layout_fingerprint must not be empty")
        if self.block_size < 1:
            raise ValueError(
                f"kv_publish_in_flight.block_size must be >= 1, got {self.block_size}")
        if self.first_block < 0:
            raise ValueError(
                f"kv_publish_in_flight.first_block must be >= 0, got {self.first_block}")
        if self.end_block <= self.first_block:
            raise ValueError(
                f"kv_publish_in_flight.end_block ({self.end_block}) must be greater than "
                f"first_block ({self.first_block})")
