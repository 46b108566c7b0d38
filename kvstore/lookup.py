"""Index-only store lookups: how many leading blocks of a prefix live store nodes hold.

The store connector (for its engine's scheduler) and the router ask this before any
byte moves: one Redis round trip (:data:`~tandem.kvstore.index.LOOKUP_LUA`: the entries
of every key plus the registry records of the nodes they name) per prompt, whatever its
length. A key whose entry is absent, malformed, or names a node without a live heartbeat
is a miss, and the count stops there: hash chains make a present block after a miss
useless for a prefix.

A lookup never raises for the index being unreachable: it answers 0 (a miss: the caller
computes), and for ``backoff_s`` afterwards answers 0 without asking, so a Redis outage
costs each caller one timeout, not one per request. Torch-free and UCX-free: the router
imports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.contracts.block_key import BlockKey
from tandem.kvstore.index import LOOKUP_LUA, NODE_PREFIX, IndexEntry, parse_lookup

logger = logging.getLogger(__name__)


def leading_live(entries: Sequence[IndexEntry | None], live_node_ids: set[str]) -> int:
    """Entries before the first one that is absent or names a node not in ``live_node_ids``."""
    n = 0
    for e in entries:
        if e is None or e.node_id not in live_node_ids:
            break
        n += 1
    return n


def _leading_from_reply(num_keys: int, reply: list[bytes | str]) -> int:
    """:func:`leading_live` of a :data:`LOOKUP_LUA` reply (ValueError when malformed)."""
    entries, nodes = parse_lookup(num_keys, reply)
    return leading_live(entries, {record[0] for record in nodes})


class _Backoff:
    """After a failure, callers skip the index for ``backoff_s`` seconds."""

    def __init__(self, backoff_s: float) -> None:
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.backoff_s = backoff_s
        self._until = 0.0
        #: lookups that failed (index unreachable or malformed reply), since start
        self.num_failures = 0

    def open(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self, exc: Exception) -> None:
        self.num_failures += 1
        self._until = time.monotonic() + self.backoff_s
        logger.warning("KV store index lookup failed (misses for %.1f s): %s",
                       self.backoff_s, exc)


class IndexProbe:
    """Blocking lookups on the caller's thread (the store connector's lookup thread).

    Args:
        redis_url: the store's index.
        timeout_s: socket connect/read timeout of one lookup, seconds (> 0).
        backoff_s: after a failed lookup, answer 0 without asking for this long.

    Raises:
        ValueError: ``timeout_s <= 0`` or ``backoff_s < 0``.
    """

    def __init__(self, redis_url: str, timeout_s: float = 0.5, backoff_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._backoff = _Backoff(backoff_s)
        # NOTE: from_url connects lazily, on the first lookup
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(LOOKUP_LUA)
        #: lookups sent to Redis, since start
        self.num_lookups = 0

    @property
    def num_failures(self) -> int:
        return self._backoff.num_failures

    def warm(self) -> None:
        """Connect and load the lookup script now (call it off the engine thread): the
        first lookup then pays one round trip, not a connection and a script load, which
        on a busy host can exceed ``timeout_s``. Failures are only logged."""
        try:
            self._redis.script_load(LOOKUP_LUA)
        except (RedisError, OSError) as exc:
            logger.info("KV store index not reachable yet: %s", exc)

    def leading(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` held by live nodes; 0 when the index is unreachable."""
        if not keys or not self._backoff.open():
            return 0
        self.num_lookups += 1
        try:
            reply = self._script(keys=[k.redis_key for k in keys], args=[NODE_PREFIX])
            return _leading_from_reply(len(keys), reply)
        except (RedisError, OSError, ValueError) as exc:
            self._backoff.failed(exc)
            return 0

    def close(self) -> None:
        self._redis.close()


class AsyncIndexProbe:
    """:class:`IndexProbe` for an asyncio loop (the router). Same arguments and answers."""

    def __init__(self, redis_url: str, timeout_s: float = 0.5, backoff_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._backoff = _Backoff(backoff_s)
        self._redis = aioredis.from_url(redis_url, socket_timeout=timeout_s,
                                        socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(LOOKUP_LUA)
        self.num_lookups = 0

    @property
    def num_failures(self) -> int:
        return self._backoff.num_failures

    async def leading(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` held by live nodes; 0 when the index is unreachable."""
        if not keys or not self._backoff.open():
            return 0
        self.num_lookups += 1
        try:
            reply = await self._script(keys=[k.redis_key for k in keys], args=[NODE_PREFIX])
            return _leading_from_reply(len(keys), reply)
        except (RedisError, OSError, ValueError) as exc:
            self._backoff.failed(exc)
            return 0

    async def aclose(self) -> None:
        await self._redis.aclose()
