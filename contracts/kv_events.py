"""KV events: an engine's prefix-cache changes as the router reads them, and their Redis keys.

vLLM's ``KVEventsConfig`` idea (``vllm/distributed/kv_events.py``): an engine publishes
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events, batched per engine step,
each naming the medium of the cache that changed (``"gpu"``, ``"cpu"``). Here a batch is one
entry of a Redis stream per engine instance (``XADD ... MAXLEN ~``), and a snapshot key holds
the whole set of cached block hashes with the sequence number of the last batch it reflects,
so a reader that missed batches (a trimmed stream, a late start) loads the snapshot and
continues from the stream.

Block hashes are ``contracts.block_hash`` chain hashes (the request's ``cache_salt`` in
block 0): the ones a router computes for a prompt with ``hash_token_blocks``.

Wire format of one stream entry (all values UTF-8 text): ``epoch`` (the publisher's random
id, new at each engine start), ``seq`` (1, 2, ... per epoch, no gaps unless a batch was
lost), ``ts`` (Unix seconds), ``events`` (a JSON list; hashes in hex). The snapshot is a
Redis hash: ``epoch``, ``seq``, ``stream_id`` (the stream entry of batch ``seq``, ``0-0``
when it was never written), ``medium`` and ``hashes`` (the raw 32-byte hashes, concatenated).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.contracts.block_hash import BLOCK_HASH_BYTES, BlockHash

#: Key prefixes in Redis; the suffix is the engine's instance id (its registry id).
STREAM_PREFIX = "tandem:kv_events:"
SNAPSHOT_PREFIX = "tandem:kv_snapshot:"
SNAPSHOT_REQUEST_PREFIX = "tandem:kv_snapshot_request:"

#: The media an event may name: the engine's device cache, or a CPU-side one.
MEDIA = ("gpu", "cpu")


def stream_key(instance_id: str) -> str:
    """The Redis stream of ``instance_id``'s event batches."""
    return STREAM_PREFIX + instance_id


def snapshot_key(instance_id: str) -> str:
    """The Redis hash holding ``instance_id``'s latest snapshot."""
    return SNAPSHOT_PREFIX + instance_id


def snapshot_request_key(instance_id: str) -> str:
    """A reader sets this key to ask ``instance_id``'s publisher for a fresh snapshot."""
    return SNAPSHOT_REQUEST_PREFIX + instance_id


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache (in chain order; ``parent_block_hash`` is the
    hash before the first one, ``None`` for a chain's first block)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    medium: str


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for new data, or never computed)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of ``medium`` left the prefix cache (a prefix-cache reset)."""

    medium: str


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, in order.

    Attributes:
        epoch: the publisher's id (new at each engine start).
        seq: 1-based, consecutive within an epoch.
        ts: Unix seconds at publication.
        events: the step's events.
    """

    epoch: str
    seq: int
    ts: float
    events: tuple[KVCacheEvent, ...]


def _event_to_json(event: KVCacheEvent) -> dict[str, object]:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {
            "type": "BlockStored",
            "block_hashes": [h.hex() for h in event.block_hashes],
            "parent_block_hash": parent.hex() if parent is not None else None,
            "block_size": event.block_size,
            "medium": event.medium,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h.hex() for h in event.block_hashes],
            "medium": event.medium,
        }
    return {"type": "AllBlocksCleared", "medium": event.medium}


def encode_batch(batch: KVEventBatch) -> dict[str, str]:
    """The stream entry's fields of ``batch``."""
    return {
        "epoch": batch.epoch,
        "seq": str(batch.seq),
        "ts": repr(batch.ts),
        "events": json.dumps([_event_to_json(e) for e in batch.events], separators=(",", ":")),
    }


def _hash(text: object) -> BlockHash:
    if not isinstance(text, str):
        raise ValueError(f"a block hash must be hex text, got {type(text).__name__}")
    raw = bytes.fromhex(text)
    if len(raw) != BLOCK_HASH_BYTES:
        raise ValueError(f"a block hash has {BLOCK_HASH_BYTES} bytes, got {len(raw)}")
    return BlockHash(raw)


def _medium(obj: Mapping[str, object]) -> str:
    medium = obj.get("medium")
    if medium not in MEDIA:
        raise ValueError(f"medium must be one of {', '.join(MEDIA)}, got {medium!r}")
    return str(medium)


def _hashes(obj: Mapping[str, object]) -> tuple[BlockHash, ...]:
    hashes = obj.get("block_hashes")
    if not isinstance(hashes, list):
        raise ValueError("block_hashes must be a list")
    return tuple(_hash(h) for h in hashes)


def decode_event(obj: object) -> KVCacheEvent:
    """One event from its JSON object.

    Raises:
        ValueError: naming what is wrong (unknown type, a bad hash, medium or size).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"an event must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind == "BlockStored":
        size = obj.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {size!r}")
        parent = obj.get("parent_block_hash")
        return BlockStored(
            _hashes(obj), None if parent is None else _hash(parent), size, _medium(obj)
        )
    if kind == "BlockRemoved":
        return BlockRemoved(_hashes(obj), _medium(obj))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared(_medium(obj))
    raise ValueError(f"unknown event type {kind!r}")


def decode_batch_header(fields: Mapping[str, str]) -> tuple[str, int, float, list[object]]:
    """``(epoch, seq, ts, raw events)`` of a stream entry; the events are decoded one by
    one with :func:`decode_event` (a bad event is dropped alone).

    Raises:
        ValueError: a missing or malformed ``epoch``, ``seq``, ``ts`` or ``events``.
    """
    try:
        epoch = fields["epoch"]
        seq = int(fields["seq"])
        ts = float(fields["ts"])
        events = json.loads(fields["events"])
    except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"malformed KV event batch: {exc!r}") from exc
    if not epoch or seq < 1 or not isinstance(events, list):
        raise ValueError(f"malformed KV event batch: epoch {epoch!r}, seq {seq}")
    return epoch, seq, ts, events


@dataclass(frozen=True)
class KVSnapshot:
    """The whole prefix cache of one engine after batch ``seq`` of ``epoch``.

    Attributes:
        epoch / seq: the last batch it reflects (``seq`` 0: before any batch).
        stream_id: the stream entry of batch ``seq`` (``"0-0"``: read the stream from the
            start and skip batches up to ``seq``).
        medium: the medium of the cache it lists.
        hashes: every cached block hash.
    """

    epoch: str
    seq: int
    stream_id: str
    medium: str
    hashes: frozenset[BlockHash]


def encode_snapshot(snap: KVSnapshot) -> dict[str, bytes]:
    """The snapshot hash's fields."""
    return {
        "epoch": snap.epoch.encode(),
        "seq": str(snap.seq).encode(),
        "stream_id": snap.stream_id.encode(),
        "medium": snap.medium.encode(),
        "hashes": b"".join(sorted(snap.hashes)),
    }


def decode_snapshot(fields: Mapping[bytes, bytes]) -> KVSnapshot:
    """A snapshot from its hash's fields (bytes keys and values, as Redis returns them).

    Raises:
        ValueError: a missing field, or ``hashes`` not a whole number of hashes.
    """
    try:
        raw = fields[b"hashes"]
        epoch, seq = fields[b"epoch"].decode(), int(fields[b"seq"])
        stream_id, medium = fields[b"stream_id"].decode(), fields[b"medium"].decode()
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed KV snapshot: {exc!r}") from exc
    if len(raw) % BLOCK_HASH_BYTES or seq < 0 or not epoch:
        raise ValueError(f"malformed KV snapshot: {len(raw)} hash bytes, seq {seq}")
    n = BLOCK_HASH_BYTES
    return KVSnapshot(
        epoch,
        seq,
        stream_id,
        medium,
        frozenset(BlockHash(raw[i : i + n]) for i in range(0, len(raw), n)),
    )


def num_event_hashes(events: Sequence[KVCacheEvent]) -> int:
    """Hashes the events name (for counters)."""
    return sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))
