"""KV events: the engine's prefix-cache changes, handed to a publisher after each step.

vLLM's ``KVEventsConfig`` / ``EventPublisher`` idea (``vllm/config/kv_events.py``,
``vllm/distributed/kv_events.py``), written anew: the block pool records
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events (``contracts.kv_events``),
the engine takes them once per step and hands them to a :class:`KVEventPublisher`, which
numbers them and ships them off the step loop. The publisher is found by name in a small
registry (the engine never imports its transport): ``"redis"`` is
``tandem.kvstore.kv_events_publisher``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.kv_events import KVCacheEvent
from tandem.engine.lazy_registry import resolve


@dataclass(frozen=True)
class KVEventsConfig:
    """Whether and where an engine publishes its prefix-cache events (vLLM's names).

    Attributes:
        enable_kv_cache_events: record and publish events (``--kv-events``).
        publisher: registry name of the publisher ("redis").
        endpoint: the publisher's endpoint: a ``redis://`` URL.
        topic: what names this engine's stream: its instance id (the registry's).
        buffer_steps: batches the stream keeps (``XADD MAXLEN ~``): how far behind a
            reader may fall before it must resync from a snapshot.
        max_queue_size: batches waiting for the publisher thread; beyond it a batch is
            dropped and counted, and the next snapshot repairs the readers.
        snapshot_interval_s: seconds between snapshots while the cache changes (a reader
            may also ask for one).

    Raises:
        ValueError: naming the field: an enabled config without ``endpoint`` or
            ``topic``, or a size or interval out of range.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "redis"
    endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    max_queue_size: int = 10_000
    snapshot_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if not self.snapshot_interval_s > 0:
            raise ValueError(f"snapshot_interval_s must be > 0, got {self.snapshot_interval_s}")
        if self.enable_kv_cache_events and not self.endpoint:
            raise ValueError(
                "kv_events: endpoint (the Redis URL) is required with enable_kv_cache_events"
            )
        if self.enable_kv_cache_events and not self.topic:
            raise ValueError(
                "kv_events: topic (the instance id) is required with enable_kv_cache_events"
            )


class KVEventPublisher(ABC):
    """Ships an engine's event batches and snapshots; never blocks the engine step.

    ``publish`` and ``publish_snapshot`` are called from the engine thread only, in step
    order; ``snapshot_due`` from any thread.
    """

    @abstractmethod
    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one step's events as the next batch (the next sequence number). Never
        blocks: a full queue drops the batch (counted) and makes a snapshot due."""

    @abstractmethod
    def publish_snapshot(self, hashes: Sequence[BlockHash]) -> None:
        """Queue a snapshot: ``hashes`` is the whole prefix cache after every batch
        published so far. Never blocks (a full queue leaves the snapshot due)."""

    @property
    @abstractmethod
    def snapshot_due(self) -> bool:
        """A snapshot should be taken now (interval elapsed with changes, a batch was
        lost, or a reader asked for one)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Flush what is queued (briefly) and stop the publisher's thread."""


#: ``(config, medium) -> publisher``.
PublisherFactory = Callable[[KVEventsConfig, str], KVEventPublisher]

#: name -> ``"module:function"`` (imported only when chosen) or a factory.
_REGISTRY: dict[str, str | PublisherFactory] = {
    "redis": "tandem.kvstore.kv_events_publisher:create_publisher",
}


def create_kv_event_publisher(config: KVEventsConfig, medium: str) -> KVEventPublisher | None:
    """The configured publisher, or ``None`` when events are off.

    Args:
        config: the engine's events config.
        medium: "gpu" or "cpu", where this engine's KV cache lives.

    Raises:
        ValueError: naming ``publisher`` when no publisher has that name.
        ImportError: the publisher's module failed to import (not swallowed).
    """
    if not config.enable_kv_cache_events:
        return None
    factory: PublisherFactory = resolve(_REGISTRY, config.publisher, "kv_events: publisher")
    return factory(config, medium)
