"""KV events to Redis: one stream per engine instance, plus a snapshot key.

The engine thread calls :meth:`RedisKVEventPublisher.publish` once per step with that
step's events; it numbers the batch and puts it on a bounded queue and returns (it never
touches the network). A background thread writes each batch with ``XADD <stream> MAXLEN ~
buffer_steps`` and each snapshot to its Redis hash (``contracts.kv_events`` has the keys
and the wire format). Faults degrade, never block: a full queue drops the batch, a Redis
error drops the batch being written; both are counted and make a snapshot due, and the
readers, seeing the gap in sequence numbers, resync from that snapshot.

Readers may ask for a fresh snapshot by setting the request key; the thread looks for it
about once a second. The keys carry a TTL refreshed while the publisher lives, so the
keys of a crashed engine do not stay in Redis for ever; a clean shutdown deletes them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.kv_events import (
    KVCacheEvent,
    KVEventBatch,
    KVSnapshot,
    encode_batch,
    encode_snapshot,
    snapshot_key,
    snapshot_request_key,
    stream_key,
)
from tandem.engine.kv_events import KVEventPublisher, KVEventsConfig

logger = logging.getLogger(__name__)

#: Seconds the keys live without a refresh (a crashed publisher's keys then go).
KEY_TTL_S = 300
#: Seconds between looks for a reader's snapshot request and TTL refreshes.
_POLL_S = 1.0
#: Seconds a Redis call may take before it counts as failed (the thread moves on).
_REDIS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class _SnapshotItem:
    seq: int
    hashes: tuple[BlockHash, ...]


_STOP = object()


class RedisKVEventPublisher(KVEventPublisher):
    """Publishes one engine's KV events to Redis from a background thread.

    Args:
        config: the engine's events config (``endpoint``: the Redis URL, ``topic``: the
            instance id naming the keys).
        medium: what the snapshot says of the cache ("gpu" or "cpu").
        client: a Redis client to use instead of one made from ``config.endpoint``.

    Attributes (counters, read from any thread):
        num_batches_published: batches written to the stream.
        num_batches_dropped: batches lost (queue full, or a Redis error while writing).
        num_snapshots_published: snapshots written.
        num_errors: Redis calls that failed.

    The publisher starts by replacing whatever its instance id held with an empty stream
    and an empty snapshot (sequence 0 of a new epoch).
    """

    def __init__(
        self, config: KVEventsConfig, medium: str, client: redis.Redis | None = None
    ) -> None:
        self._config = config
        self._medium = medium
        self.epoch = uuid.uuid4().hex
        self.stream_key = stream_key(config.topic)
        self.snapshot_key = snapshot_key(config.topic)
        self._request_key = snapshot_request_key(config.topic)
        self._redis = (
            client
            if client is not None
            else redis.Redis.from_url(
                config.endpoint or "",
                socket_timeout=_REDIS_TIMEOUT_S,
                socket_connect_timeout=_REDIS_TIMEOUT_S,
            )
        )
        self._queue: queue.Queue[object] = queue.Queue(config.max_queue_size)
        self._seq = 0  # engine thread only
        self._last_id = "0-0"  # publisher thread only: the last stream entry written
        self._needed = True  # a snapshot must be taken (set by any thread)
        self._changed = False  # batches published since the last snapshot
        self._last_snapshot_s = time.monotonic()
        self.num_batches_published = 0
        self.num_batches_dropped = 0
        self.num_snapshots_published = 0
        self.num_errors = 0
        self._fresh_start = True  # the thread clears old keys before its first write
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.publish_snapshot(())

    @property
    def last_seq(self) -> int:
        """Sequence number of the last batch handed to :meth:`publish` (0: none yet)."""
        return self._seq

    # -- engine thread -------------------------------------------------------------------

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        self._seq += 1
        self._changed = True
        batch = KVEventBatch(self.epoch, self._seq, time.time(), tuple(events))
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_batches_dropped += 1
            self._needed = True

    def publish_snapshot(self, hashes: Sequence[BlockHash]) -> None:
        try:
            self._queue.put_nowait(_SnapshotItem(self._seq, tuple(hashes)))
        except queue.Full:
            self._needed = True
            return
        self._needed = self._changed = False
        self._last_snapshot_s = time.monotonic()

    @property
    def snapshot_due(self) -> bool:
        return self._needed or (
            self._changed
            and time.monotonic() - self._last_snapshot_s >= self._config.snapshot_interval_s
        )

    def shutdown(self) -> None:
        """Write what is queued (up to a few seconds), stop the thread, delete the keys."""
        try:
            self._queue.put(_STOP, timeout=_REDIS_TIMEOUT_S)
        except queue.Full:
            logger.warning("KV events: queue still full at shutdown; stopping anyway")
        self._thread.join(timeout=2 * _REDIS_TIMEOUT_S)
        try:
            self._redis.delete(self.stream_key, self.snapshot_key, self._request_key)
        except redis.RedisError:
            logger.warning("KV events: could not delete %s (its TTL removes it)", self.stream_key)
        self._redis.close()

    # -- publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        next_poll = 0.0
        while True:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            try:
                if self._fresh_start:
                    self._redis.delete(self.stream_key, self._request_key)
                    self._fresh_start = False
                if isinstance(item, KVEventBatch):
                    self._write_batch(item)
                elif isinstance(item, _SnapshotItem):
                    self._write_snapshot(item)
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + _POLL_S
                    self._poll()
            except redis.RedisError as exc:
                self.num_errors += 1
                if isinstance(item, KVEventBatch):
                    self.num_batches_dropped += 1
                self._needed = True
                # NOTE: one line per failure would flood the log during an outage.
                if self.num_errors == 1 or self.num_errors % 1000 == 0:
                    logger.warning(
                        "KV events: Redis write failed (%s); %d batches dropped "
                        "so far, a snapshot will repair the readers",
                        exc,
                        self.num_batches_dropped,
                    )

    def _write_batch(self, batch: KVEventBatch) -> None:
        entry_id = self._redis.xadd(
            self.stream_key,
            encode_batch(batch),  # type: ignore[arg-type]
            maxlen=self._config.buffer_steps,
            approximate=True,
        )
        self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        self.num_batches_published += 1

    def _write_snapshot(self, item: _SnapshotItem) -> None:
        snap = KVSnapshot(self.epoch, item.seq, self._last_id, self._medium, frozenset(item.hashes))
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.snapshot_key)
            pipe.hset(self.snapshot_key, mapping=encode_snapshot(snap))  # type: ignore[arg-type]
            pipe.expire(self.snapshot_key, KEY_TTL_S)
            pipe.expire(self.stream_key, KEY_TTL_S)
            pipe.execute()
        self.num_snapshots_published += 1

    def _poll(self) -> None:
        """A reader's snapshot request, and the keys' TTLs."""
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.delete(self._request_key)
            pipe.expire(self.snapshot_key, KEY_TTL_S)
            pipe.expire(self.stream_key, KEY_TTL_S)
            asked, _, _ = pipe.execute()
        if asked:
            self._needed = True


def create_publisher(config: KVEventsConfig, medium: str) -> RedisKVEventPublisher:
    """The ``"redis"`` entry of ``engine.kv_events``'s registry."""
    return RedisKVEventPublisher(config, medium)
