"""Where ``/v1/responses`` keeps the responses it stores (``store: true``, the default) for
``previous_response_id`` and ``GET /v1/responses/{id}``: each for a bounded time (a TTL).

``RedisResponseStore`` keeps them in Redis (``--response-store-url``, by default the
router's ``--redis-url``), so that any router replica continues a conversation another one
started; ``MemoryResponseStore`` keeps them in the router's memory (one replica only, at
most ``max_entries``), for a router without Redis. A record is a JSON object: the response
as the API returned it and the conversation up to its end as chat messages.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any, Protocol

#: Redis key prefix of a stored response (``tandem:response:<id>``).
KEY_PREFIX = "tandem:response:"


class ResponseStore(Protocol):
    """Stored responses by id. Both methods are coroutines; neither blocks the loop."""

    ttl_s: int

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` under ``response_id`` for ``ttl_s`` seconds (replacing any).

        Raises:
            redis.RedisError (Redis store): Redis unreachable.
        """

    async def get(self, response_id: str) -> dict[str, Any] | None:
        """The record of ``response_id``; ``None`` when it was never stored or expired.

        Raises:
            redis.RedisError (Redis store): Redis unreachable.
        """

    async def aclose(self) -> None:
        """Release connections."""


class RedisResponseStore:
    """Records in Redis as JSON strings with an expiry (``SET ... EX ttl_s``).

    Args:
        url: ``redis://host:port/db``.
        ttl_s: seconds a record is kept (>= 1).

    Raises:
        ValueError: ``ttl_s`` below 1.
    """

    def __init__(self, url: str, ttl_s: int) -> None:
        if ttl_s < 1:
            raise ValueError(f"response store ttl_s must be >= 1, got {ttl_s}")
        import redis.asyncio as aioredis  # only a router that stores responses needs it

        self.ttl_s = ttl_s
        self._redis = aioredis.from_url(url, decode_responses=True)

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        await self._redis.set(KEY_PREFIX + response_id, json.dumps(record), ex=self.ttl_s)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        raw = await self._redis.get(KEY_PREFIX + response_id)
        return json.loads(raw) if raw is not None else None

    async def aclose(self) -> None:
        await self._redis.aclose()


class MemoryResponseStore:
    """Records in this process, oldest dropped first beyond ``max_entries``.

    Args:
        ttl_s: seconds a record is kept (>= 1).
        max_entries: most records kept at once (>= 1).

    Raises:
        ValueError: ``ttl_s`` or ``max_entries`` below 1.
    """

    def __init__(self, ttl_s: int, max_entries: int = 10_000) -> None:
        if ttl_s < 1 or max_entries < 1:
            raise ValueError(f"ttl_s and max_entries must be >= 1, got {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._records: OrderedDict[str, tuple[float, str]] = OrderedDict()

    async def put(self, response_id: str, record: dict[str, Any]) -> None:
        self._records.pop(response_id, None)
        self._records[response_id] = (time.monotonic() + self.ttl_s, json.dumps(record))
        while len(self._records) > self.max_entries:
            self._records.popitem(last=False)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        expires, raw = entry
        if time.monotonic() >= expires:
            del self._records[response_id]
            return None
        return json.loads(raw)

    async def aclose(self) -> None:
        self._records.clear()
