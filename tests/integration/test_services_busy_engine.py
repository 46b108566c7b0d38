"""An engine busy in one long step must not make its instance look dead.

Bug (H9, found with `make up`): a long prefill step (an 8000-token prompt takes tens of
seconds on a loaded CPU) held the engine thread; the registry heartbeat and ``GetLoad``
both waited for the step to end, so the instance's Redis key expired (TTL 10 s), the
router's ``/ready`` went 503 and every new request got 503 "no healthy engine instance"
until the step ended. Here the long step is a fake engine whose step blocks until the
test releases it (a step of a real model cannot be made long on demand); the registry
test uses a real Redis.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import redis
from stuck_engine import StuckStepEngine

from tandem.services.common.engine_loop import EngineLoop
from tandem.services.common.registry import InstanceRegistration


def test_stats_answer_while_the_engine_is_in_a_long_step() -> None:
    """``EngineLoop.stats`` returns the last snapshot instead of waiting for the step."""
    engine = StuckStepEngine()

    async def scenario() -> None:
        engine_loop = EngineLoop(engine, asyncio.get_running_loop())
        engine_loop.start()
        try:
            idle = await engine_loop.stats()
            assert idle.num_running == 0
            await engine_loop.add_request(SimpleNamespace(request_id="long"))
            assert await asyncio.to_thread(engine.in_step.wait, 30)
            # The step is still running: the answer is the last snapshot, not a hang.
            stale = await asyncio.wait_for(engine_loop.stats(), timeout=30)
            assert stale is idle
            assert engine.in_step.is_set() and not engine.release.is_set()
            engine.release.set()
            deadline = time.monotonic() + 30
            while (await engine_loop.stats()) is idle:  # fresh once the step ended
                assert time.monotonic() < deadline, "stats never refreshed after the step"
                await asyncio.sleep(0.01)
        finally:
            engine.release.set()
            await engine_loop.shutdown()

    asyncio.run(scenario())


def test_heartbeat_keeps_the_key_alive_when_load_never_answers(redis_url: str) -> None:
    """The registry key keeps being refreshed (with the last known load) while the load
    callback is stuck behind a long engine step."""
    calls = 0
    stuck = asyncio.Event()  # never set: the engine thread never answers

    async def load() -> dict[str, float | int]:
        nonlocal calls
        calls += 1
        if calls > 1:
            await stuck.wait()
        return {"running": 3, "waiting": 0, "kv_usage": 0.5, "num_free_blocks": 7}

    client = redis.Redis.from_url(redis_url, decode_responses=True)

    async def scenario() -> None:
        reg = InstanceRegistration(redis_url, "prefill", "busy-test", "127.0.0.1:1", "m",
                                   load, ttl_s=10, interval_s=0.05)
        await reg.start()
        try:
            first = float(client.hget(reg.key, "updated_at"))
            deadline = time.monotonic() + 30
            seen: set[float] = {first}
            while len(seen) < 3:  # two more beats while the load call hangs
                assert time.monotonic() < deadline, "heartbeat stuck behind the load call"
                await asyncio.sleep(0.05)
                value = client.hget(reg.key, "updated_at")
                assert value is not None, "registry key expired: heartbeat stuck behind load"
                seen.add(float(value))
            assert calls > 1
            entry = client.hgetall(reg.key)
            assert entry["running"] == "3" and entry["num_free_blocks"] == "7"
            assert client.ttl(reg.key) > 0
        finally:
            await reg.stop()
        assert not client.exists(reg.key)

    try:
        asyncio.run(scenario())
    finally:
        client.close()
