"""``--kv-events`` of the engine services: the flag, its config, and the snapshot task.

An engine started with ``--kv-events`` publishes its prefix cache's changes to the Redis
of ``--redis-url`` (``engine/kv_events.py``, ``kvstore/kv_events_publisher.py``) on the
topic of its instance id, which its registry entry names (``kv_events_topic``) so the
routers find the stream. Snapshots are taken in the engine thread (the only one that may
read the block pool) when the publisher says one is due: checked once a second here, so
an idle engine answers a router's request for one too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from tandem.engine.config import EngineConfig
from tandem.engine.kv_events import KVEventsConfig
from tandem.services.common.engine_loop import EngineLoop
from tandem.services.common.periodic import start_periodic

logger = logging.getLogger(__name__)

#: Seconds between looks at whether a snapshot is due.
SNAPSHOT_CHECK_S = 1.0


def add_kv_events_flag(parser: argparse.ArgumentParser) -> None:
    """``--kv-events`` / ``--no-kv-events`` (default off; ``tandem up`` turns it on)."""
    parser.add_argument(
        "--kv-events",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="publish the prefix cache's changes (block stored / removed / all cleared, "
        "vLLM's KV events) to a Redis stream of this instance on --redis-url, so every "
        "router replica routes on what this engine really holds (default: off)",
    )


def with_kv_events(config: EngineConfig, ns: argparse.Namespace) -> EngineConfig:
    """``config`` with the KV-events settings of the flags (``ns.instance_id`` set).

    Raises:
        ValueError: ``--kv-events`` without ``--redis-url``.
    """
    if not ns.kv_events:
        return config
    if not ns.redis_url:
        raise ValueError("--kv-events requires --redis-url (the events go to that Redis)")
    events = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=ns.redis_url, topic=ns.instance_id
    )
    return dataclasses.replace(config, kv_events=events)


async def start_snapshot_task(engine_loop: EngineLoop) -> asyncio.Task[None] | None:
    """Take a snapshot in the engine thread whenever the publisher says one is due
    (``None``: KV events are off). Stop it with ``periodic.stop_periodic``."""
    engine = engine_loop.engine
    publisher = engine.kv_event_publisher
    if publisher is None:
        return None

    async def tick() -> None:
        if publisher.snapshot_due:
            await engine_loop.call(engine.publish_kv_snapshot)

    return await start_periodic(tick, SNAPSHOT_CHECK_S, what="KV events snapshot", log=logger)
