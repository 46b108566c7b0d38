"""KV events of the block pool and their wire format: replaying the events gives exactly
the prefix cache's key set; a malformed event or batch is refused by name."""

from __future__ import annotations

import json
import random

import pytest

from tandem.contracts.block_hash import hash_token_blocks
from tandem.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
    decode_batch_header,
    decode_event,
    decode_snapshot,
    encode_batch,
    encode_snapshot,
)
from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.kv_events import KVEventsConfig, create_kv_event_publisher
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams


def replay(events: list, held: set) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            held.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held.difference_update(e.block_hashes)
        else:
            held.clear()


def test_events_off_records_nothing() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hash_token_blocks(list(range(8)), 4), 0, 2)
    assert pool.take_events() == []


def test_stored_run_names_its_parent_and_evictions_coalesce() -> None:
    pool = BlockPool(3, enable_kv_cache_events=True, medium="cpu", block_size=4)
    hashes = hash_token_blocks(list(range(12)), 4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 1, 3)
    assert pool.take_events() == [BlockStored(tuple(hashes[1:3]), hashes[0], 4, "cpu")]
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(3)  # evicts both cached blocks: one event
    (removed,) = pool.take_events()
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == set(hashes[1:3])
    pool.free_blocks(pool.blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared("cpu")]


def test_replayed_events_equal_the_cache_under_eviction_pressure() -> None:
    """Random requests over shared prefixes on a 10-block cache: after every operation,
    the hashes the events leave equal the pool's map."""
    rng = random.Random(0)
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    mgr.enable_kv_cache_events("gpu")
    held: set = set()
    num_removed = 0
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0.0))
        hit, n_hit = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, len(prompt) - n_hit, n_hit, hit) is None:
            continue
        req.num_computed_tokens = len(prompt) if rng.random() < 0.8 else n_hit  # or aborted
        req.status = RequestStatus.FINISHED_STOPPED
        mgr.free(req)
        events = mgr.take_events()
        num_removed += sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
        replay(events, held)
        assert held == set(mgr.block_pool.cached_block_hash_to_block)
    assert num_removed > 0, "the test should evict"


def test_wire_format_round_trip_and_malformed_input() -> None:
    h = hash_token_blocks(list(range(8)), 4)
    batch = KVEventBatch(
        "e1",
        3,
        1.5,
        (
            BlockStored((h[1],), h[0], 4, "gpu"),
            BlockRemoved((h[0],), "gpu"),
            AllBlocksCleared("gpu"),
        ),
    )
    epoch, seq, ts, raw = decode_batch_header(encode_batch(batch))
    assert (epoch, seq, ts) == ("e1", 3, 1.5)
    assert tuple(decode_event(o) for o in raw) == batch.events
    with pytest.raises(ValueError, match="unknown event type"):
        decode_event({"type": "BlockMoved"})
    with pytest.raises(ValueError, match="medium"):
        decode_event({"type": "AllBlocksCleared", "medium": "tape"})
    with pytest.raises(ValueError, match="32 bytes"):
        decode_event({"type": "BlockRemoved", "block_hashes": ["abcd"], "medium": "gpu"})
    with pytest.raises(ValueError, match="malformed KV event batch"):
        decode_batch_header({"epoch": "e1", "seq": "x", "ts": "1", "events": "[]"})
    with pytest.raises(ValueError, match="malformed KV event batch"):
        decode_batch_header({"epoch": "e1", "seq": "1", "ts": "1", "events": json.dumps({})})
    snap = KVSnapshot("e1", 7, "5-0", "cpu", frozenset(h))
    fields = {k.encode(): v for k, v in encode_snapshot(snap).items()}
    assert decode_snapshot(fields) == snap
    with pytest.raises(ValueError, match="malformed KV snapshot"):
        decode_snapshot({**fields, b"hashes": b"\x00" * 5})


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        KVEventsConfig(enable_kv_cache_events=True, topic="a")
    with pytest.raises(ValueError, match="topic"):
        KVEventsConfig(enable_kv_cache_events=True, endpoint="redis://x")
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig(buffer_steps=0)
    with pytest.raises(ValueError, match="publisher must be one of"):
        create_kv_event_publisher(
            KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint="redis://x", topic="a"
            ),
            "gpu",
        )
    assert create_kv_event_publisher(KVEventsConfig(), "gpu") is None
