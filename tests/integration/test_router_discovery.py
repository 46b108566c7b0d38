"""The router's Redis discovery against a real redis-server: registrations, graceful
deregistrations and a registry that restarts empty.

Regression for: a Redis restart emptied the registry, the next refresh emptied the router's
view, and for up to one heartbeat (2 s) the router answered 503 "no healthy engine instance"
although every engine was alive and answering its load polls (seen as a flaky
tests/e2e/test_router_faults.py::test_redis_killed_under_load_requests_keep_their_text).

Engines register through the real writer (``InstanceRegistration.beat``); the load poller's
verdict is set on the view's entries as ``poll_loads`` does. The restart grace runs on a fake
clock, so nothing here waits for time to pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis
from ports import free_port
from redis_server import RedisServer

from tandem.contracts.role import Role
from tandem.services.common.registry import TTL_S, InstanceRegistration
from tandem.services.router.discovery import RedisDiscovery

MODEL = "m"


class FakeClock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def redis_srv() -> Iterator[RedisServer]:
    """A redis-server of this test's own (restarting the session's one would empty the
    registry under other modules' services)."""
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


def _registration(url: str, role: Role, address: str, running: int = 0
                  ) -> InstanceRegistration:
    async def load() -> dict[str, float | int]:
        return {"running": running, "waiting": 0, "kv_usage": 0.0, "num_free_blocks": 7}

    return InstanceRegistration(url, role, address.replace(":", "-"), address, MODEL, load)


def _run(body: Callable[[RedisDiscovery, FakeClock], Awaitable[None]], url: str) -> None:
    """Run ``body(discovery, clock)`` in one event loop, closing the discovery after."""
    async def main() -> None:
        clock = FakeClock()
        d = RedisDiscovery(url, model=MODEL, clock=clock)
        try:
            await body(d, clock)
        finally:
            await d.stop()

    asyncio.run(main())


async def _refresh_after_restart(d: RedisDiscovery) -> None:
    """``d.refresh()`` as the router's refresh loop runs it after a restart: a try that
    meets a connection the old server closed fails (the loop logs it) and the next tick
    reconnects. One failure per pooled connection at most; the pool holds one here."""
    for _ in range(2):
        try:
            await d.refresh()
            return
        except redis.ConnectionError:
            continue
    await d.refresh()


def _addresses(d: RedisDiscovery) -> list[str]:
    return sorted(i.address for i in d.all_instances())


def _set_alive(d: RedisDiscovery, **alive: bool | None) -> None:
    """Record load poll verdicts the way ``InstancePool.poll_loads`` does (keyword: the
    address's host letter, e.g. ``a=True`` for ``a:1``)."""
    for host, verdict in alive.items():
        info = d.get(f"{host}:1")
        assert info is not None, f"{host}:1 is not in the view"
        info.alive = verdict


def test_a_registry_restart_keeps_the_live_instances_until_they_register_again(
        redis_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """Redis restarts empty: the instances whose last poll answered stay in the view (a
    warning names how many), the ones that failed or were never polled leave; one that
    registers again is read from the registry again, fresh fields and no grace left."""
    async def body(d: RedisDiscovery, clock: FakeClock) -> None:
        regs = {h: _registration(redis_srv.url, Role.DECODE, f"{h}:1") for h in "abc"}
        prefill = _registration(redis_srv.url, Role.PREFILL, "p:1")
        for reg in (*regs.values(), prefill):
            await reg.beat()
        await d.refresh()
        assert _addresses(d) == ["a:1", "b:1", "c:1", "p:1"]
        _set_alive(d, a=True, b=False, c=None, p=True)

        redis_srv.restart()
        with caplog.at_level(logging.WARNING, logger="tandem.services.router.discovery"):
            await _refresh_after_restart(d)
        assert _addresses(d) == ["a:1", "p:1"]
        assert [i.address for i in d.instances(Role.DECODE)] == ["a:1"]
        assert [i.address for i in d.instances(Role.PREFILL)] == ["p:1"]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "keeping 2 live instance(s)" in warnings[0], warnings

        # a refresh with the same run_id is no new restart: no second warning
        caplog.clear()
        clock.now_s += 1.0
        await d.refresh()
        assert _addresses(d) == ["a:1", "p:1"]
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]

        fresh = _registration(redis_srv.url, Role.DECODE, "a:1", running=5)
        await fresh.beat()
        await d.refresh()
        a = d.get("a:1")
        assert a is not None
        assert (a.running, a.num_free_blocks, a.alive) == (5, 7, True)
        assert a.updated_at > 0.0

        # Registered again, it is no longer kept: deleting its key drops it at once.
        await fresh.stop()
        await d.refresh()
        assert _addresses(d) == ["p:1"]
        for reg in (*regs.values(), prefill):
            await reg.stop()

    _run(body, redis_srv.url)


def test_a_deregistered_instance_leaves_at_once_even_if_alive(redis_srv: RedisServer) -> None:
    """A key deleted while Redis stays up (a graceful stop) drops its instance at the next
    refresh, though its last poll answered: a draining engine still answers GetLoad."""
    async def body(d: RedisDiscovery, clock: FakeClock) -> None:
        a = _registration(redis_srv.url, Role.DECODE, "a:1")
        b = _registration(redis_srv.url, Role.DECODE, "b:1")
        await a.beat()
        await b.beat()
        await d.refresh()
        _set_alive(d, a=True, b=True)

        await a.stop()
        await d.refresh()
        assert _addresses(d) == ["b:1"]
        assert d.is_down("a:1")
        await b.stop()

    _run(body, redis_srv.url)


def test_a_kept_instance_leaves_after_one_registry_ttl_or_when_its_poll_fails(
        redis_srv: RedisServer) -> None:
    """After a restart, a kept instance that has not registered again leaves the view once
    one registry TTL has passed since the restart was seen, and one whose load poll fails
    during the grace leaves at the next refresh."""
    async def body(d: RedisDiscovery, clock: FakeClock) -> None:
        regs = [_registration(redis_srv.url, Role.DECODE, f"{h}:1") for h in "ab"]
        for reg in regs:
            await reg.beat()
        await d.refresh()
        _set_alive(d, a=True, b=True)

        redis_srv.restart()
        await _refresh_after_restart(d)
        seen_at_s = clock.now_s
        assert _addresses(d) == ["a:1", "b:1"]

        _set_alive(d, b=False)
        clock.now_s = seen_at_s + TTL_S - 1.0
        await d.refresh()
        assert _addresses(d) == ["a:1"]

        clock.now_s = seen_at_s + TTL_S
        await d.refresh()
        assert _addresses(d) == []
        assert d.instances(Role.DECODE) == []
        for reg in regs:
            await reg.stop()

    _run(body, redis_srv.url)


def test_without_a_run_id_a_registry_restart_empties_the_view_as_before(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Redis that refuses INFO (a proxy or a managed server may) reports no ``run_id``:
    a restart cannot be told from deregistrations, so nothing is kept; a warning says so
    once, and refreshes keep working."""
    server = RedisServer(free_port(), extra_args=["--rename-command", "INFO", ""])
    server.start()

    async def body(d: RedisDiscovery, clock: FakeClock) -> None:
        reg = _registration(server.url, Role.DECODE, "a:1")
        await reg.beat()
        with caplog.at_level(logging.WARNING, logger="tandem.services.router.discovery"):
            await d.refresh()
            _set_alive(d, a=True)
            server.restart()
            await _refresh_after_restart(d)
        assert _addresses(d) == []
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "refuses INFO server" in warnings[0], warnings
        again = _registration(server.url, Role.DECODE, "a:1")
        await again.beat()
        await d.refresh()
        assert _addresses(d) == ["a:1"]
        await again.stop()
        await reg.stop()

    try:
        _run(body, server.url)
    finally:
        server.stop()
