"""n > 1 fan-out (engine/fan_out.py): one child-id scheme and seed rule for the offline
engine and the router."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine.fan_out import child_request_id, fan_out
from tandem.engine.sampling_params import SamplingParams


def test_single_completion_keeps_the_request_id() -> None:
    params = SamplingParams(seed=5, max_tokens=3)
    [only] = fan_out("req", params)
    assert (only.index, only.request_id) == (0, "req")
    assert only.sampling_params == params and only.sampling_params is not params


def test_children_ids_seeds_and_n() -> None:
    children = fan_out("req", SamplingParams(n=3, seed=10, temperature=0.7))
    assert [c.index for c in children] == [0, 1, 2]
    assert [c.request_id for c in children] == ["req-0", "req-1", "req-2"]
    assert [c.request_id for c in children] == [child_request_id("req", i) for i in range(3)]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 and c.sampling_params.temperature == 0.7
               for c in children)
    assert [c.sampling_params.seed for c in fan_out("r", SamplingParams(n=2))] == [None, None]


@pytest.mark.parametrize("n", [1, 3])
def test_router_pipeline_runs_the_fan_out_children(monkeypatch, n) -> None:
    """Bug pinned: the router named children ``{rid}-{i}`` and the offline engine
    ``{i}_{rid}``; both now take ids and seeds from ``fan_out``."""
    from tandem.services.router.client import InstancePool
    from tandem.services.router.discovery import StaticDiscovery
    from tandem.services.router.metrics import RouterMetrics
    from tandem.services.router.pipeline import Pipeline
    from tandem.services.router.routing import RoundRobinRouter
    from tandem.services.router.sequence import GenerationRequest

    seen: list[tuple[int, str, int | None]] = []

    async def fake_run_seq(self, index, req, sp, seq_id, router_queue_ns, trace):  # noqa: ANN001
        seen.append((index, seq_id, sp.seed))
        assert sp.n == 1
        return
        yield  # an async generator that yields nothing

    monkeypatch.setattr(Pipeline, "_run_seq", fake_run_seq)
    discovery = StaticDiscovery(both=["127.0.0.1:1"])
    pipeline = Pipeline(tokenizer=None, discovery=discovery, pool=InstancePool(discovery),
                        router=RoundRobinRouter(), metrics=RouterMetrics("m"))
    params = SamplingParams(n=n, seed=4)
    req = GenerationRequest("rid", [1, 2, 3], params)

    async def drain() -> None:
        async for _ in pipeline.generate(req):
            pass

    asyncio.run(drain())
    want = [(c.index, c.request_id, c.sampling_params.seed) for c in fan_out("rid", params)]
    assert sorted(seen) == want


def test_merge_streams_interleaves_raises_and_cancels_on_close() -> None:
    """The router's one fan-in (n completions, several prompts): items in arrival order,
    the first error raised, and an early close cancels the streams still running."""
    from tandem.services.router.merge import merge_streams

    cancelled: list[str] = []

    async def stream(name: str, count: int, fail: bool = False, block: bool = False):
        try:
            for i in range(count):
                yield f"{name}{i}"
                await asyncio.sleep(0)
            if fail:
                raise RuntimeError(f"{name} failed")
            if block:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def collect(streams):
        return [x async for x in merge_streams(streams)]

    got = asyncio.run(collect([stream("a", 2), stream("b", 3)]))
    assert sorted(got) == ["a0", "a1", "b0", "b1", "b2"]
    assert asyncio.run(collect([stream("only", 2)])) == ["only0", "only1"]
    with pytest.raises(RuntimeError, match="b failed"):
        asyncio.run(collect([stream("a", 1, block=True), stream("b", 1, fail=True)]))
    assert cancelled == ["a"]

    async def first_then_close() -> str:
        merged = merge_streams([stream("x", 1, block=True), stream("y", 1, block=True)])
        first = await anext(merged)
        await merged.aclose()
        return first

    cancelled.clear()
    assert asyncio.run(first_then_close()) in {"x0", "y0"}
    assert sorted(cancelled) == ["x", "y"]
