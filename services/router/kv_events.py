"""The router's view of each engine's prefix cache, built from the engines' KV events.

Engines started with ``--kv-events`` publish their prefix cache's changes to Redis
(``contracts.kv_events``: one stream per instance, numbered batches, a snapshot key). This
reader follows the streams of the instances discovery lists (their registry entry names a
``kv_events_topic``) and keeps, per instance, the set of block hashes its cache holds: the
same on every router replica that reads the same streams (what vLLM's, Dynamo's and
llm-d's KV-event routers do).

Per instance: the reader starts by loading the snapshot (the whole set and the sequence
number it reflects), then applies the stream's batches after it. A batch whose number is
not the next one (the stream was trimmed under a slow reader, a batch was lost, the engine
restarted) triggers a resync from the snapshot; when the snapshot is older than the gap the
reader asks the publisher for a fresh one and waits for it, the instance meanwhile counted
as not synced (the routing policy then uses its guessed view). A malformed batch or event
is dropped and counted, never raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from redis.exceptions import RedisError

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch_header,
    decode_event,
    decode_snapshot,
    snapshot_key,
    snapshot_request_key,
    stream_key,
)

logger = logging.getLogger(__name__)

#: Seconds a snapshot request lives (the publisher looks about once a second).
_REQUEST_TTL_S = 30


@dataclass
class _Follow:
    """One instance's stream position and cache view."""

    topic: str
    epoch: str = ""
    seq: int = -1
    last_id: str = "0-0"
    synced: bool = False
    #: the (epoch, seq) a snapshot must reach to repair a gap (``None``: any)
    need: tuple[str, int] | None = None
    retry_at: float = 0.0
    hashes: dict[str, set[BlockHash]] = field(default_factory=dict)

    def holds(self, h: BlockHash) -> bool:
        return any(h in s for s in self.hashes.values())


@dataclass
class KVEventsCounters:
    """What the reader did, cumulative (for metrics and tests).

    Attributes:
        batches_applied: stream entries applied to a view.
        malformed_batches: stream entries dropped whole (unreadable header).
        malformed_events: single events dropped (unknown type, bad hash or medium).
        resyncs: views (re)loaded from a snapshot.
        gaps: batches out of sequence that triggered a resync.
        snapshot_requests: fresh snapshots asked of a publisher.
    """

    batches_applied: int = 0
    malformed_batches: int = 0
    malformed_events: int = 0
    resyncs: int = 0
    gaps: int = 0
    snapshot_requests: int = 0


class KVEventsReader:
    """Follows the KV-event streams of the instances ``topics()`` names.

    Args:
        redis_url: the Redis the engines publish to (the router's discovery Redis).
        topics: the current instances' topics (their instance ids), asked every round;
            a topic that leaves it is forgotten.
        read_count: most entries read per stream and round.
        block_ms: how long one read waits for new entries (milliseconds).
        retry_s: seconds between snapshot reads while an instance waits for one.

    Reads happen in :meth:`poll` (one round) or a background task (:meth:`start`); the
    views are read with :meth:`matched_blocks` from the same event loop (no lock).
    """

    def __init__(
        self,
        redis_url: str,
        topics: Callable[[], Iterable[str]],
        *,
        read_count: int = 1000,
        block_ms: int = 50,
        retry_s: float = 0.5,
    ) -> None:
        self._redis = aioredis.from_url(redis_url)
        self._topics = topics
        self._read_count = read_count
        self._block_ms = block_ms
        self._retry_s = retry_s
        self._follows: dict[str, _Follow] = {}
        self.counters = KVEventsCounters()
        self._task: asyncio.Task[None] | None = None

    # -- queries -------------------------------------------------------------------------

    def matched_blocks(self, topic: str, hashes: Sequence[BlockHash]) -> int | None:
        """Leading ``hashes`` in ``topic``'s cache, or ``None`` when its view is not synced
        (never read yet, or waiting for a snapshot). Never blocks."""
        f = self._follows.get(topic)
        if f is None or not f.synced:
            return None
        n = 0
        for h in hashes:
            if not f.holds(h):
                break
            n += 1
        return n

    def cached_hashes(self, topic: str) -> set[BlockHash] | None:
        """Every hash in ``topic``'s view (all media), ``None`` when not synced."""
        f = self._follows.get(topic)
        if f is None or not f.synced:
            return None
        return set().union(*f.hashes.values())

    def position(self, topic: str) -> tuple[str, int] | None:
        """``(epoch, seq)`` of the last batch applied to ``topic``'s view (synced only)."""
        f = self._follows.get(topic)
        return (f.epoch, f.seq) if f is not None and f.synced else None

    def collect(self) -> Iterable[Metric]:
        """Prometheus collector (``registry.register(reader)``): the counters as
        ``tandem:router_kv_events_*_total`` and the synced views as a gauge."""
        c = self.counters
        for name, value, doc in (
            ("batches_applied", c.batches_applied, "KV event batches applied to a view."),
            ("malformed_batches", c.malformed_batches, "Unreadable KV event entries dropped."),
            ("malformed_events", c.malformed_events, "Malformed single KV events dropped."),
            ("resyncs", c.resyncs, "Views (re)loaded from an engine's snapshot."),
            ("gaps", c.gaps, "KV event batches out of sequence (each starts a resync)."),
            ("snapshot_requests", c.snapshot_requests, "Fresh snapshots asked of engines."),
        ):
            yield CounterMetricFamily(f"tandem:router_kv_events_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "tandem:router_kv_events_synced_instances",
            "Engines whose prefix-cache view is built from their KV events now.",
            value=sum(1 for f in self._follows.values() if f.synced),
        )

    # -- reading -------------------------------------------------------------------------

    async def poll(self, block_ms: int | None = None) -> int:
        """One round: resync the views that need it, then read and apply new entries
        (waiting up to ``block_ms``, default the reader's, when none is ready).

        Returns:
            Batches applied this round.

        Raises:
            redis.RedisError: Redis unreachable (the views are kept as they were).
        """
        topics = set(self._topics())
        for gone in self._follows.keys() - topics:
            del self._follows[gone]
        now = time.monotonic()
        for topic in topics:
            f = self._follows.setdefault(topic, _Follow(topic))
            if not f.synced and now >= f.retry_at:
                await self._resync(f)
        synced: dict[Any, Any] = {
            stream_key(f.topic): f.last_id for f in self._follows.values() if f.synced
        }
        if not synced:
            if block_ms is None and self._block_ms:
                await asyncio.sleep(self._block_ms / 1000)
            return 0
        wait = self._block_ms if block_ms is None else block_ms
        # NOTE: block=None (not 0) when not waiting: XREAD BLOCK 0 waits for ever.
        reply: Any = await self._redis.xread(synced, count=self._read_count, block=wait or None)
        before = self.counters.batches_applied
        for key, entries in reply or ():
            name = key.decode() if isinstance(key, bytes) else key
            follow = self._follows.get(name[len(stream_key("")) :])
            if follow is not None and follow.synced:
                await self._apply_entries(follow, entries)
        return self.counters.batches_applied - before

    async def _apply_entries(self, f: _Follow, entries: list[Any]) -> None:
        for entry_id, raw in entries:
            f.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            fields = {
                (k.decode() if isinstance(k, bytes) else k): (
                    v.decode(errors="replace") if isinstance(v, bytes) else v
                )
                for k, v in raw.items()
            }
            try:
                epoch, seq, _, events = decode_batch_header(fields)
            except ValueError:
                self.counters.malformed_batches += 1
                continue  # the next batch shows the gap, if the lost one changed anything
            if epoch != f.epoch and seq == 1:
                f.epoch, f.seq, f.hashes = epoch, 0, {}  # a new engine life: empty cache
            if epoch == f.epoch and seq <= f.seq:
                continue  # already in the snapshot the view started from
            if epoch != f.epoch or seq != f.seq + 1:
                self.counters.gaps += 1
                f.synced, f.need = False, (epoch, seq - 1)
                await self._resync(f)
                return
            self._apply(f, events)
            f.seq = seq
            self.counters.batches_applied += 1

    def _apply(self, f: _Follow, events: list[object]) -> None:
        for obj in events:
            try:
                event = decode_event(obj)
            except ValueError:
                self.counters.malformed_events += 1
                continue
            held = f.hashes.setdefault(event.medium, set())
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    async def _resync(self, f: _Follow) -> None:
        """Load ``f``'s snapshot if it repairs what ``f.need`` says, else ask for a fresh
        one and try again after ``retry_s``."""
        f.retry_at = time.monotonic() + self._retry_s
        try:
            fields: Any = await self._redis.hgetall(snapshot_key(f.topic))
            snap = decode_snapshot(fields) if fields else None
        except ValueError:
            self.counters.malformed_batches += 1
            snap = None
        need = f.need
        # NOTE: a snapshot of another epoch than the gap's is the engine's next life (a
        # publisher writes its first snapshot before any batch): it repairs the gap.
        fresh_enough = snap is not None and (
            need is None or snap.epoch != need[0] or snap.seq >= need[1]
        )
        if snap is None or not fresh_enough:
            await self._redis.set(snapshot_request_key(f.topic), b"1", ex=_REQUEST_TTL_S)
            self.counters.snapshot_requests += 1
            return
        f.epoch, f.seq, f.last_id = snap.epoch, snap.seq, snap.stream_id
        f.hashes = {snap.medium: set(snap.hashes)}
        f.synced, f.need = True, None
        self.counters.resyncs += 1

    # -- background task -----------------------------------------------------------------

    async def _run(self) -> None:
        errors = 0
        while True:
            try:
                await self.poll()
                errors = 0
            except asyncio.CancelledError:
                raise
            except RedisError as exc:
                errors += 1
                if errors == 1:
                    logger.warning("KV events: Redis read failed (%s); views kept, retrying", exc)
                await asyncio.sleep(min(1.0, 0.05 * errors))
            except Exception:  # noqa: BLE001 - a bug must not stop the reader for good
                logger.exception("KV events: reader round failed")
                await asyncio.sleep(1.0)

    async def start(self) -> None:
        """Read in a background task until :meth:`stop`."""
        self._task = asyncio.create_task(self._run(), name="kv-events-reader")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self._redis.aclose()
