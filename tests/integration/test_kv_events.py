"""KV events end to end: real engines (tiny random Llama) publish to a real redis-server,
router views (``KVEventsReader``) follow the streams.

- under eviction pressure, each view equals its engine's prefix cache, asserted from
  both sides after every round;
- two routers fed by the same streams route a prompt to the same instance, the one whose
  cache holds it, even where their own guesses say otherwise;
- a view started late resyncs from the snapshot and continues from the stream;
- a stream trimmed under a slow view triggers a resync (a fresh snapshot asked for);
- a malformed stream entry is dropped and counted; a Redis outage drops batches, counts
  them and makes a snapshot due.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis
from ports import free_port
from prometheus_client import CollectorRegistry, generate_latest
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model
from waiting import wait_until

from tandem.contracts.kv_events import stream_key
from tandem.contracts.role import Role
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.kv_events import KVEventsConfig
from tandem.engine.model_loader import LoadedModel
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kvstore.kv_events_publisher import RedisKVEventPublisher
from tandem.services.router.discovery import InstanceInfo
from tandem.services.router.kv_events import KVEventsReader
from tandem.services.router.routing import CacheView, KVAwareRouter, RouteContext

VOCAB = 101
MAX_LEN = 96
BLOCK = 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    config = tiny_config(
        "LlamaForCausalLM", vocab=VOCAB, hidden=32, ffn=64, max_len=MAX_LEN, special_tokens=False
    )
    return as_loaded_model(tiny_hf_model(config, std=0.3), "tiny-llama", MAX_LEN)


def make_core(
    loaded: LoadedModel, redis_url: str, num_blocks: int = 16, buffer_steps: int = 10_000
) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        kv_events=KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=redis_url,
            topic=f"t-{uuid.uuid4().hex[:8]}",
            buffer_steps=buffer_steps,
            snapshot_interval_s=3600.0,
        ),
    )
    return EngineCore(config, create_executor(config, loaded))


def publisher(core: EngineCore) -> RedisKVEventPublisher:
    pub = core.kv_event_publisher
    assert isinstance(pub, RedisKVEventPublisher)
    return pub


def topic(core: EngineCore) -> str:
    return core.config.kv_events.topic


def run(core: EngineCore, prompts: list[list[int]], max_tokens: int = 3) -> None:
    for p in prompts:
        core.add_request(
            Request(f"r{next(_ids)}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        )
    while core.has_unfinished_requests():
        core.step()


def engine_hashes(core: EngineCore) -> set:
    return set(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block)


async def poll_until(
    reader: KVEventsReader,
    cond: Callable[[], bool],
    what: str,
    timeout_s: float = 20.0,
    tick: Callable[[], None] = lambda: None,
) -> None:
    """Read rounds until ``cond()`` holds (``tick`` runs between rounds)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        tick()
        await reader.poll(block_ms=50)


async def caught_up(reader: KVEventsReader, core: EngineCore, **kw: object) -> None:
    """Until the view has applied every batch the engine published, and every batch
    written to Redis (the publisher thread has no backlog)."""
    pub = publisher(core)

    def done() -> bool:
        return reader.position(topic(core)) == (pub.epoch, pub.last_seq)

    def snapshot_if_due() -> None:  # what the service's periodic task does
        if pub.snapshot_due:
            core.publish_kv_snapshot()

    await poll_until(
        reader, done, f"the view of {topic(core)} to catch up", tick=snapshot_if_due, **kw
    )  # type: ignore[arg-type]


def with_reader(
    redis_url: str, topics: list[str], body: Callable[[KVEventsReader], Awaitable[None]]
) -> None:
    async def main() -> None:
        reader = KVEventsReader(redis_url, lambda: topics, block_ms=50, retry_s=0.05)
        try:
            await body(reader)
        finally:
            await reader.stop()

    asyncio.run(main())


def test_view_equals_engine_cache_under_eviction(tiny: LoadedModel, redis_url: str) -> None:
    core = make_core(tiny, redis_url, num_blocks=12)
    rng = random.Random(1)
    shared = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(4)]

    async def body(reader: KVEventsReader) -> None:
        ever: set = set()
        for _ in range(6):
            prompts = [
                rng.choice(shared) + [rng.randrange(VOCAB) for _ in range(5)] for _ in range(3)
            ]
            run(core, prompts)
            await caught_up(reader, core)
            ever |= engine_hashes(core)
            view = reader.cached_hashes(topic(core))
            assert view == engine_hashes(core)  # the router's side == the engine's side
        assert len(ever) > core.num_blocks, "the cache should have evicted"
        assert reader.counters.malformed_batches == reader.counters.gaps == 0

    try:
        with_reader(redis_url, [topic(core)], body)
    finally:
        core.shutdown()


def test_two_routers_route_alike_from_the_same_streams(tiny: LoadedModel, redis_url: str) -> None:
    cores = [make_core(tiny, redis_url), make_core(tiny, redis_url)]
    infos = [
        InstanceInfo(
            role=Role.PREFILL, address=f"127.0.0.1:{i}", block_size=BLOCK, kv_events_topic=topic(c)
        )
        for i, c in enumerate(cores)
    ]
    rng = random.Random(2)
    docs = [[rng.randrange(VOCAB) for _ in range(24)] for _ in range(2)]
    run(cores[0], [docs[0] + [1]])
    run(cores[1], [docs[1] + [2]])

    async def body(reader_a: KVEventsReader) -> None:
        reader_b = KVEventsReader(redis_url, lambda: [topic(c) for c in cores], block_ms=50)
        try:
            for c in cores:
                await caught_up(reader_a, c)
                await caught_up(reader_b, c)
            routers = [KVAwareRouter(CacheView(events=r)) for r in (reader_a, reader_b)]
            # router B guessed wrong: it believes instance 1 holds doc 0
            routers[1].view.record(infos[1], RouteContext(Role.PREFILL, docs[0] + [1]))
            for doc, want in ((docs[0], infos[0]), (docs[1], infos[1])):
                ctx = RouteContext(Role.PREFILL, doc + [7, 8])
                chosen = [await r.choose(infos, ctx) for r in routers]
                assert chosen == [want, want]
        finally:
            await reader_b.stop()

    try:
        with_reader(redis_url, [topic(c) for c in cores], body)
    finally:
        for c in cores:
            c.shutdown()


def test_late_view_resyncs_from_snapshot(tiny: LoadedModel, redis_url: str) -> None:
    core = make_core(tiny, redis_url, num_blocks=12)
    rng = random.Random(3)
    run(core, [[rng.randrange(VOCAB) for _ in range(14)] for _ in range(6)])
    core.publish_kv_snapshot()
    run(core, [[rng.randrange(VOCAB) for _ in range(10)] for _ in range(2)])  # after it
    client = redis.Redis.from_url(redis_url)
    # the view starts late, after the stream lost its early batches
    client.xtrim(stream_key(topic(core)), maxlen=3, approximate=False)

    async def body(reader: KVEventsReader) -> None:
        await caught_up(reader, core)
        assert reader.cached_hashes(topic(core)) == engine_hashes(core)
        assert reader.counters.resyncs >= 1
        run(core, [[rng.randrange(VOCAB) for _ in range(9)]])  # continues from the stream
        await caught_up(reader, core)
        assert reader.cached_hashes(topic(core)) == engine_hashes(core)

    try:
        with_reader(redis_url, [topic(core)], body)
    finally:
        client.close()
        core.shutdown()


def test_trimmed_stream_triggers_a_resync(tiny: LoadedModel, redis_url: str) -> None:
    core = make_core(tiny, redis_url, num_blocks=12)
    rng = random.Random(4)
    client = redis.Redis.from_url(redis_url)

    async def body(reader: KVEventsReader) -> None:
        run(core, [[rng.randrange(VOCAB) for _ in range(10)]])
        await caught_up(reader, core)
        resyncs = reader.counters.resyncs
        # the view falls behind while the stream is trimmed past it
        run(core, [[rng.randrange(VOCAB) for _ in range(13)] for _ in range(5)])
        pub = publisher(core)
        await poll_until(
            reader,
            lambda: pub.num_batches_published == pub.last_seq,
            "the batches to be written",
        )
        client.xtrim(stream_key(topic(core)), maxlen=1, approximate=False)
        await caught_up(reader, core)
        assert reader.counters.gaps >= 1
        assert reader.counters.snapshot_requests >= 1
        assert reader.counters.resyncs > resyncs
        assert reader.cached_hashes(topic(core)) == engine_hashes(core)

    try:
        with_reader(redis_url, [topic(core)], body)
    finally:
        client.close()
        core.shutdown()


def test_malformed_entry_is_dropped_and_counted(tiny: LoadedModel, redis_url: str) -> None:
    core = make_core(tiny, redis_url)
    client = redis.Redis.from_url(redis_url)

    async def body(reader: KVEventsReader) -> None:
        run(core, [list(range(1, 11))])
        await caught_up(reader, core)
        client.xadd(stream_key(topic(core)), {"epoch": "x", "seq": "nope", "events": "{"})
        run(core, [list(range(20, 33))])
        await caught_up(reader, core)
        assert reader.counters.malformed_batches == 1
        assert reader.counters.gaps == 0  # the garbage took no sequence number
        registry = CollectorRegistry()
        registry.register(reader)  # as the router's /metrics does
        text = generate_latest(registry).decode()
        assert "tandem:router_kv_events_malformed_batches_total 1.0" in text
        assert "tandem:router_kv_events_synced_instances 1.0" in text
        assert reader.cached_hashes(topic(core)) == engine_hashes(core)

    try:
        with_reader(redis_url, [topic(core)], body)
    finally:
        client.close()
        core.shutdown()


def test_redis_outage_drops_counts_and_asks_for_a_snapshot() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    pub = RedisKVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=dead, topic="down", max_queue_size=2),
        "cpu",
    )
    try:
        for _ in range(6):
            pub.publish([])
        # the publisher thread works through its queue: full-queue drops, then failed writes
        wait_until(lambda: pub.num_batches_dropped == 6, 20, "every batch to be dropped")
        assert pub.num_batches_dropped == 6  # queue-full drops plus failed writes
        assert pub.num_batches_published == 0
        assert pub.snapshot_due
    finally:
        pub.shutdown()
