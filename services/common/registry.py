"""Registration of an engine instance in Redis, with a heartbeat TTL.

Key ``tandem:instance:<role>:<instance_id>``: a hash with fields ``role``
(prefill|decode|both), ``address`` (host:port of the gRPC server), ``model``,
``running``, ``waiting``, ``kv_usage`` (0..1), ``num_free_blocks``, the model's facts
as ``GetLoadResponse`` names them (``max_model_len_tokens``, ``vocab_size_tokens``,
``architecture``, ``model_impl``: ``ServiceContext.registry_facts``),
``kv_events_topic`` (only for an engine publishing KV events: ``contracts.kv_events``)
and ``updated_at`` (Unix seconds). The key expires ``ttl_s`` (10 s) after the last
heartbeat, which comes every ``interval_s`` (2 s): a crashed instance vanishes
from the registry within 10 s; a stopped one deletes its key at once.
The router (services/router/discovery.py) reads these keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from tandem.contracts.role import Role
from tandem.services.common.periodic import start_periodic, stop_periodic

logger = logging.getLogger(__name__)

KEY_PREFIX = "tandem:instance"
TTL_S = 10
INTERVAL_S = 2.0


def instance_key(role: Role, instance_id: str) -> str:
    """Redis key of one instance."""
    return f"{KEY_PREFIX}:{Role(role).value}:{instance_id}"


class InstanceRegistration:
    """Keeps one instance's registry entry fresh.

    Args:
        redis_url: ``redis://host:port/db``.
        role: the instance's role (its value is the ``role`` field).
        instance_id: unique id of this process.
        address: gRPC ``host:port`` the router should dial.
        model: model id served.
        load_fn: async callable returning the load fields (``running``,
            ``waiting``, ``kv_usage``, ``num_free_blocks``) and the model's facts as a dict.
        kv_events_topic: the topic of its KV events ("": it publishes none).
    """

    def __init__(
        self,
        redis_url: str,
        role: Role,
        instance_id: str,
        address: str,
        model: str,
        load_fn: Callable[[], Awaitable[dict[str, float | int | str]]],
        ttl_s: int = TTL_S,
        interval_s: float = INTERVAL_S,
        kv_events_topic: str = "",
    ) -> None:
        self.key = instance_key(role, instance_id)
        self._redis = aioredis.from_url(redis_url)
        self._static = {"role": Role(role).value, "address": address, "model": model}
        if kv_events_topic:
            self._static["kv_events_topic"] = kv_events_topic
        self._load_fn = load_fn
        self._ttl_s = ttl_s
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._last_load: dict[str, float | int | str] = {}

    async def beat(self) -> None:
        """Write the entry once (fields + TTL) in one transaction.

        The load fields come from ``load_fn`` if it answers within ``interval_s``, else
        the last ones it gave: the entry's TTL must never depend on the engine thread
        (busy for a long step, e.g. a long prefill), or the instance would vanish from
        the registry while it works.

        Raises:
            redis.RedisError: Redis unreachable (callers in the heartbeat task log it).
        """
        # redis' hset takes a Mapping, whose key type is invariant: the fields are
        # typed as its own FieldT (of which str is one) and filled through items().
        fields: dict[FieldT, EncodableT] = {}
        fields.update(self._static.items())
        try:
            self._last_load = await asyncio.wait_for(self._load_fn(), self._interval_s)
        except asyncio.TimeoutError:  # noqa: UP041 - a distinct class on Python 3.10
            logger.debug("load report slow (engine busy); heartbeat keeps the last one")
        fields.update(self._last_load.items())
        fields["updated_at"] = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, mapping=fields)
            pipe.expire(self.key, self._ttl_s)
            await pipe.execute()

    async def start(self) -> None:
        """Register now, then heartbeat in the background (an unreachable Redis is
        logged and retried every interval, never fatal)."""
        self._task = await start_periodic(
            self.beat, self._interval_s, what="registry heartbeat to Redis", log=logger
        )

    async def stop(self) -> None:
        """Stop the heartbeat and delete the entry (so the router stops routing here)."""
        await stop_periodic(self._task)
        self._task = None
        try:
            await self._redis.delete(self.key)
        except Exception:  # noqa: BLE001 - the TTL removes it anyway
            logger.warning("could not delete registry key %s", self.key, exc_info=True)
        await self._redis.aclose()
