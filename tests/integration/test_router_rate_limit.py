"""services/router/rate_limit.py: the sliding one-minute window of tenants' requests and
tokens, on a real redis-server (the Lua scripts) and in memory, with an injected clock:
no sleeps, exact counts and waits."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as redis

from tandem.services.router.rate_limit import (
    Decision,
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
)
from tandem.services.router.tenants import Tenant

T0 = 1_700_000_000.0  # a whole second: bucket boundaries fall on whole seconds


class Clock:
    """Seconds since the epoch, moved by the test."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


async def _limiters(kind: str, redis_url: str, clock: Clock, n: int = 1
                    ) -> list[RateLimiter]:
    """``n`` limiters sharing one window: Redis replicas, or one memory limiter."""
    if kind == "memory":
        return [MemoryRateLimiter(clock)] * n
    prefix = f"test:{uuid.uuid4().hex}"
    return [RedisRateLimiter(redis.Redis.from_url(redis_url), clock, prefix)
            for _ in range(n)]


@pytest.fixture(params=["redis", "memory"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def _close(limiters: list[RateLimiter]) -> None:
    for limiter in dict.fromkeys(limiters):
        await limiter.aclose()


def test_requests_per_minute_then_the_window_frees(kind: str, redis_url: str) -> None:
    async def main() -> None:
        clock = Clock()
        (lim,) = await _limiters(kind, redis_url, clock)
        alpha, beta = Tenant("alpha", requests_per_minute=2), Tenant("beta",
                                                                       requests_per_minute=2)
        try:
            assert (await lim.admit(alpha, 10)).admitted
            clock.now += 10.5
            assert (await lim.admit(alpha, 10)).admitted
            clock.now += 5
            refused = await lim.admit(alpha, 10)
            # the first request (second T0) leaves the window at T0 + 60
            assert refused == Decision(None, "requests_per_minute", 60_000 - 15_500)
            assert refused.retry_after_s == 45
            assert (await lim.admit(beta, 10)).admitted  # another tenant: its own window
            clock.now = T0 + 59.999
            assert not (await lim.admit(alpha, 10)).admitted
            clock.now = T0 + 60
            assert (await lim.admit(alpha, 10)).admitted  # the first one has left
            refused = await lim.admit(alpha, 10)
            assert refused.retry_after_ms == 10_000 and refused.limit == "requests_per_minute"
        finally:
            await _close([lim])

    run(main())


def test_tokens_per_minute_waits_for_enough_to_leave(kind: str, redis_url: str) -> None:
    async def main() -> None:
        clock = Clock()
        (lim,) = await _limiters(kind, redis_url, clock)
        tenant = Tenant("alpha", tokens_per_minute=100)
        try:
            assert (await lim.admit(tenant, 30)).admitted  # second 0
            clock.now += 20
            assert (await lim.admit(tenant, 30)).admitted  # second 20
            clock.now += 20
            assert (await lim.admit(tenant, 30)).admitted  # second 40: 90 in the window
            clock.now += 5
            # 70 more fit only once the first two buckets (60 tokens) have left: at T0 + 80
            refused = await lim.admit(tenant, 70)
            assert refused == Decision(None, "tokens_per_minute", 80_000 - 45_000)
            assert (await lim.admit(tenant, 10)).admitted  # 100: exactly the limit
            too_big = await lim.admit(tenant, 101)  # more than the whole limit: never
            assert too_big == Decision(None, "tokens_per_minute", None)
            assert too_big.retry_after_s is None
            clock.now = T0 + 80  # 40 left in the window (the 10 above included)
            assert not (await lim.admit(tenant, 61)).admitted
            assert (await lim.admit(tenant, 60)).admitted
        finally:
            await _close([lim])

    run(main())


def test_settling_returns_unused_tokens_to_the_window(kind: str, redis_url: str) -> None:
    async def main() -> None:
        clock = Clock()
        (lim,) = await _limiters(kind, redis_url, clock)
        tenant = Tenant("alpha", tokens_per_minute=100)
        try:
            first = await lim.admit(tenant, 80)  # prompt 20 + max_tokens 60 reserved
            assert first.ticket is not None and first.ticket.num_tokens == 80
            assert not (await lim.admit(tenant, 50)).admitted
            await lim.settle(first.ticket, 25)  # it used 25
            assert (await lim.admit(tenant, 50)).admitted  # 75 now
            assert not (await lim.admit(tenant, 26)).admitted
            # a request settled after its bucket left the window changes nothing
            clock.now = T0 + 30
            late = await lim.admit(tenant, 25)  # 100 in the window
            assert late.ticket is not None
            clock.now = T0 + 60  # second 0 has left: 25 remain
            await lim.settle(first.ticket, 0)
            assert (await lim.admit(tenant, 75)).admitted
            assert not (await lim.admit(tenant, 1)).admitted
        finally:
            await _close([lim])

    run(main())


def test_replicas_on_one_redis_share_one_limit(redis_url: str) -> None:
    async def main() -> None:
        clock = Clock()
        one, two = await _limiters("redis", redis_url, clock, n=2)
        tenant = Tenant("alpha", requests_per_minute=3, tokens_per_minute=1000)
        try:
            assert (await one.admit(tenant, 100)).admitted
            assert (await one.admit(tenant, 100)).admitted
            assert (await two.admit(tenant, 100)).admitted
            refused = await two.admit(tenant, 100)  # the first replica used two of three
            assert refused == Decision(None, "requests_per_minute", 60_000)
            assert not (await one.admit(tenant, 100)).admitted
        finally:
            await _close([one, two])

    run(main())


def test_concurrent_admissions_never_exceed_the_limit(redis_url: str) -> None:
    async def main() -> None:
        clock = Clock()
        limiters = await _limiters("redis", redis_url, clock, n=4)
        tenant = Tenant("alpha", requests_per_minute=1000, tokens_per_minute=1000)
        try:
            decisions = await asyncio.gather(*(limiters[i % 4].admit(tenant, 7)
                                               for i in range(200)))
            assert sum(d.admitted for d in decisions) == 1000 // 7
        finally:
            await _close(limiters)

    run(main())


def test_keys_expire_a_minute_after_the_last_admission(redis_url: str) -> None:
    async def main() -> None:
        client = redis.Redis.from_url(redis_url)
        prefix = f"test:{uuid.uuid4().hex}"
        lim = RedisRateLimiter(client, Clock(), prefix)
        try:
            assert (await lim.admit(Tenant("alpha", requests_per_minute=5), 3)).admitted
            for key in (f"{prefix}:{{alpha}}:requests", f"{prefix}:{{alpha}}:tokens"):
                assert 60_000 < await client.pttl(key) <= 61_000
        finally:
            await lim.aclose()

    run(main())
