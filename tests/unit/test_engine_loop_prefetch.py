"""``EngineLoop`` starts a request's KV lookups on arrival (``prefetch_kv``) and drops
them for every request the engine does not take: rejected, a duplicate id, cancelled
before the engine thread added it. A fake engine records the calls; once its step
blocks, a cancelled add is still queued behind the step."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from stuck_engine import StuckStepEngine

from tandem.services.common.engine_loop import EngineLoop


def test_prefetches_are_dropped_for_requests_the_engine_did_not_take() -> None:
    engine = StuckStepEngine(blocking=False)

    async def scenario() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        try:
            bad = SimpleNamespace(request_id="bad", bad=True)
            with pytest.raises(ValueError, match="max_tokens"):
                await loop.add_request(bad)
            assert engine.prefetched == [bad] and engine.dropped == [bad]

            first = SimpleNamespace(request_id="a", bad=False)
            await loop.add_request(first)
            twin = SimpleNamespace(request_id="a", bad=False)
            with pytest.raises(ValueError, match="already in flight"):
                await loop.add_request(twin)
            assert engine.dropped == [bad, twin], "the request in flight keeps its lookup"

            # The engine thread is inside a step: a cancelled add never runs, and its
            # prefetch is dropped once the thread gets to it.
            engine.release.clear()
            engine.in_step.clear()
            await loop.add_request(SimpleNamespace(request_id="b", bad=False))
            assert await asyncio.to_thread(engine.in_step.wait, 30)
            late = SimpleNamespace(request_id="late", bad=False)
            task = asyncio.ensure_future(loop.add_request(late))
            await asyncio.sleep(0)
            assert engine.prefetched[-1] is late
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            engine.release.set()
            await loop.call(lambda: None)  # runs after the queued jobs
            assert engine.dropped == [bad, twin, late]
            assert [r.request_id for r in engine.prefetched] == ["bad", "a", "a", "b", "late"]
        finally:
            engine.release.set()
            await loop.shutdown()

    asyncio.run(scenario())
