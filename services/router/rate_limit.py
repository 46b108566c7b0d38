"""Per-tenant request and token limits over a sliding one-minute window.

The window is kept as one-second buckets (the "sliding window of counters" of rate
limiters such as Envoy's and Cloudflare's, here with exact per-second counts rather than
an interpolated previous window): a request is admitted when the requests, and the tokens,
of the buckets of the last 60 seconds plus its own stay within the tenant's limits. A
refused request is told when the window frees enough: the moment the oldest buckets whose
counts must leave it do so. Admitting is check-and-count in one step; settling replaces a
request's reserved tokens by the tokens it actually used, in the bucket it was counted in
(nothing once that bucket has left the window).

Two implementations: :class:`RedisRateLimiter` (one Lua script per step, so every router
replica on one Redis enforces one limit) and :class:`MemoryRateLimiter` (this process
only). Both read the time from an injected clock (wall-clock seconds: replicas share
windows, so their clocks must agree, as NTP keeps them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.services.router.tenants import Tenant

#: The window's length and its buckets' width, in milliseconds.
WINDOW_MS = 60_000
BUCKET_MS = 1_000
_NUM_BUCKETS = WINDOW_MS // BUCKET_MS


@dataclass(frozen=True)
class Ticket:
    """An admitted request's place in its tenant's window, to settle it.

    Attributes:
        tenant: the tenant's name.
        bucket: the one-second bucket it was counted in (ms since the epoch // 1000).
        num_tokens: the tokens reserved for it.
    """

    tenant: str
    bucket: int
    num_tokens: int


@dataclass(frozen=True)
class Decision:
    """The answer of :meth:`RateLimiter.admit`.

    Attributes:
        ticket: the admitted request's ticket; ``None``: refused.
        limit: for a refusal, the limit that refused it (``requests_per_minute`` or
            ``tokens_per_minute``; the first of them when both did).
        retry_after_ms: for a refusal, milliseconds until the window frees enough for it
            (the later of the two limits' moments, traffic since aside); ``None`` when it
            never will (it needs more tokens than the tenant's whole limit).
    """

    ticket: Ticket | None
    limit: str | None = None
    retry_after_ms: int | None = None

    @property
    def admitted(self) -> bool:
        return self.ticket is not None

    @property
    def retry_after_s(self) -> int | None:
        """``retry_after_ms`` in whole seconds, rounded up (the ``Retry-After`` header)."""
        if self.retry_after_ms is None:
            return None
        return max(1, math.ceil(self.retry_after_ms / 1000))


def _decision(tenant: Tenant, bucket: int, num_tokens: int, wait_requests_ms: int,
              wait_tokens_ms: int) -> Decision:
    """Admitted when both waits are 0; a wait of -1 means never."""
    if wait_requests_ms == 0 and wait_tokens_ms == 0:
        return Decision(Ticket(tenant.name, bucket, num_tokens))
    limit = "requests_per_minute" if wait_requests_ms != 0 else "tokens_per_minute"
    if wait_requests_ms < 0 or wait_tokens_ms < 0:
        return Decision(None, limit, None)
    return Decision(None, limit, max(wait_requests_ms, wait_tokens_ms))


class RateLimiter:
    """Check-and-count of tenants' requests and tokens in a sliding one-minute window.

    Args:
        clock: the time in seconds since the epoch (``time.time``; tests inject theirs).
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def admit(self, tenant: Tenant, num_tokens: int) -> Decision:
        """Count one request of ``num_tokens`` tokens against ``tenant``'s limits if both
        leave room for it, atomically; else count nothing. Does not block beyond the
        store's round trip.

        Raises:
            the store's errors (``redis.RedisError``) when it cannot be reached.
        """
        raise NotImplementedError

    async def settle(self, ticket: Ticket, num_tokens: int) -> None:
        """Replace ``ticket``'s reserved tokens by ``num_tokens`` (what it used) in the
        bucket it was counted in; nothing once that bucket has left the window.

        Raises:
            the store's errors (``redis.RedisError``) when it cannot be reached.
        """
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release the store's connections."""


def _wait_ms(buckets: dict[int, int], oldest: int, now_ms: int, need: int,
             limit: int | None) -> int:
    """Milliseconds until ``need`` more fits under ``limit`` in the window whose buckets
    from ``oldest`` on are ``buckets``: 0 now, -1 never. (The Lua script's twin.)"""
    total = sum(v for b, v in buckets.items() if b >= oldest)
    if limit is None or total + need <= limit:
        return 0
    if need > limit:
        return -1
    for b in sorted(b for b in buckets if b >= oldest):
        total -= buckets[b]
        if total + need <= limit:
            return (b + _NUM_BUCKETS) * BUCKET_MS - now_ms
    raise AssertionError("an empty window holds any need within the limit")


class MemoryRateLimiter(RateLimiter):
    """The limits of this router process alone (no Redis: each replica its own)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        # tenant -> bucket -> count
        self._requests: dict[str, dict[int, int]] = {}
        self._tokens: dict[str, dict[int, int]] = {}

    async def admit(self, tenant: Tenant, num_tokens: int) -> Decision:
        now_ms = self._now_ms()
        current = now_ms // BUCKET_MS
        oldest = current - _NUM_BUCKETS + 1
        requests = self._requests.setdefault(tenant.name, {})
        tokens = self._tokens.setdefault(tenant.name, {})
        for buckets in (requests, tokens):
            for b in [b for b in buckets if b < oldest]:
                del buckets[b]
        decision = _decision(
            tenant, current, num_tokens,
            _wait_ms(requests, oldest, now_ms, 1, tenant.requests_per_minute),
            _wait_ms(tokens, oldest, now_ms, num_tokens, tenant.tokens_per_minute))
        if decision.admitted:
            requests[current] = requests.get(current, 0) + 1
            tokens[current] = tokens.get(current, 0) + num_tokens
        return decision

    async def settle(self, ticket: Ticket, num_tokens: int) -> None:
        tokens = self._tokens.get(ticket.tenant, {})
        oldest = self._now_ms() // BUCKET_MS - _NUM_BUCKETS + 1
        if ticket.bucket >= oldest and ticket.bucket in tokens:
            tokens[ticket.bucket] = max(0, tokens[ticket.bucket]
                                        + num_tokens - ticket.num_tokens)


# KEYS[1], KEYS[2]: the tenant's request and token hashes (bucket -> count).
# ARGV: now (ms), window (ms), bucket width (ms), request limit, token limit (0: none),
# the request's tokens. Returns {1, bucket} when admitted, else {0, wait for requests,
# wait for tokens} (ms; 0: that limit has room, -1: never). Mirrors _wait_ms.
_ADMIT_LUA = """
local now_ms = tonumber(ARGV[1])
local bucket_ms = tonumber(ARGV[3])
local num_buckets = tonumber(ARGV[2]) / bucket_ms
local max_requests = tonumber(ARGV[4])
local max_tokens = tonumber(ARGV[5])
local cost = tonumber(ARGV[6])
local current = math.floor(now_ms / bucket_ms)
local oldest = current - num_buckets + 1

local function window(key)
  local flat = redis.call('HGETALL', key)
  local live, stale, total = {}, {}, 0
  for i = 1, #flat, 2 do
    local b, v = tonumber(flat[i]), tonumber(flat[i + 1])
    if b < oldest then
      stale[#stale + 1] = flat[i]
    else
      total = total + v
      live[#live + 1] = {b, v}
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(live, function(x, y) return x[1] < y[1] end)
  return total, live
end

local function wait_ms(total, live, need, limit)
  if limit == 0 or total + need <= limit then return 0 end
  if need > limit then return -1 end
  for _, bv in ipairs(live) do
    total = total - bv[2]
    if total + need <= limit then return (bv[1] + num_buckets) * bucket_ms - now_ms end
  end
  return -1
end

local requests, live_requests = window(KEYS[1])
local tokens, live_tokens = window(KEYS[2])
local wait_requests = wait_ms(requests, live_requests, 1, max_requests)
local wait_tokens = wait_ms(tokens, live_tokens, cost, max_tokens)
if wait_requests == 0 and wait_tokens == 0 then
  local field = string.format('%d', current)
  redis.call('HINCRBY', KEYS[1], field, 1)
  redis.call('HINCRBY', KEYS[2], field, cost)
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + bucket_ms)
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]) + bucket_ms)
  return {1, current}
end
return {0, wait_requests, wait_tokens}
"""

# KEYS[1]: the tenant's token hash. ARGV: the bucket, the change in tokens. A bucket that
# has left the window (or was pruned) stays gone.
_SETTLE_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  if redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2]) < 0 then
    redis.call('HSET', KEYS[1], ARGV[1], 0)
  end
end
return 0
"""


class RedisRateLimiter(RateLimiter):
    """The limits of every router replica sharing one Redis.

    Each tenant has two hashes, ``{prefix}:{tenant}:requests`` and ``...:tokens``
    (bucket -> count; the braces are a cluster hash tag, so both live on one shard),
    which expire a minute after their last admission.

    Args:
        client: a ``redis.asyncio.Redis`` (this object closes it in :meth:`aclose`).
        clock: as ``RateLimiter``.
        prefix: the keys' prefix.
    """

    def __init__(self, client: Any, clock: Callable[[], float] = time.time,
                 prefix: str = "tandem:ratelimit") -> None:
        super().__init__(clock)
        self._client = client
        self._prefix = prefix
        self._admit = client.register_script(_ADMIT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    @classmethod
    def from_url(cls, url: str, clock: Callable[[], float] = time.time,
                 prefix: str = "tandem:ratelimit") -> RedisRateLimiter:
        """A limiter on the Redis at ``url`` (``redis://host:port/db``); connects lazily."""
        import redis.asyncio as redis

        return cls(redis.Redis.from_url(url), clock, prefix)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}:{{{tenant}}}"
        return [f"{base}:requests", f"{base}:tokens"]

    async def admit(self, tenant: Tenant, num_tokens: int) -> Decision:
        out = await self._admit(keys=self._keys(tenant.name), args=[
            self._now_ms(), WINDOW_MS, BUCKET_MS, tenant.requests_per_minute or 0,
            tenant.tokens_per_minute or 0, num_tokens])
        if int(out[0]) == 1:
            return Decision(Ticket(tenant.name, int(out[1]), num_tokens))
        return _decision(tenant, 0, num_tokens, int(out[1]), int(out[2]))

    async def settle(self, ticket: Ticket, num_tokens: int) -> None:
        delta = num_tokens - ticket.num_tokens
        if delta:
            await self._settle(keys=self._keys(ticket.tenant)[1:],
                               args=[ticket.bucket, delta])

    async def aclose(self) -> None:
        await self._client.aclose()
