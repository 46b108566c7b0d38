"""The store KV connector (kvstore/connector.py) over an in-process block store.

The fake store is plugged in the way any connector is: a registered connector built by
``build_store_connector`` with its own client, found by name through the engine's
registry. The transfer threads are the real ones.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from kv_shard_cases import assert_shards_hold, split
from transfer_recorder import Recorder
from waiting import wait_until

from tandem.contracts.block_hash import prompt_block_hashes
from tandem.contracts.block_key import BlockKey, KVTransferParams
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import KVConnectorConfig, KVTransferConfig
from tandem.engine.kv_connector import (
    KVConnectorScheduler,
    KVConnectorWorker,
    create_connector,
    register_connector,
    unregister_connector,
)
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import SchedulerOutput
from tandem.kvstore import connector_transfers
from tandem.kvstore.connector import (
    StoreConnectorConfig,
    build_store_connector,
)
from tandem.kvstore.connector import (
    create_connector as create_store_connector,
)
from tandem.kvstore.store import BlockStore

BS = 4
LAYOUT = KVCacheLayout("tiny", num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32",
                       block_size=BS)
PROMPT = list(range(10))  # 2 full blocks and a partial one


class DictBlockStore(BlockStore):
    """A ``BlockStore`` over a dict; ``fail_puts`` makes every put raise."""

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, torch.Tensor] = {}
        self.fail_puts = False
        self.num_connects = 0
        self.closed = False

    def connect(self) -> DictBlockStore:
        self.num_connects += 1
        return self

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return next((i for i, k in enumerate(keys) if k not in self.blocks), len(keys))

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor],
                   ttl_s: float | None = None, *,
                   trace_headers: Mapping[str, str] | None = None) -> int:
        if self.fail_puts:
            raise ConnectionError("store down")
        for k, b in zip(keys, blocks, strict=True):
            self.blocks.setdefault(k, b.clone())
        return len(keys)

    def get_blocks(self, keys: Sequence[BlockKey], into: Sequence[torch.Tensor]) -> int:
        for i, k in enumerate(keys):
            block = self.blocks.get(k)
            if block is None:
                return i
            into[i].copy_(block)
        return len(keys)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def store() -> Iterator[DictBlockStore]:
    s = DictBlockStore()
    register_connector(
        "dict-store",
        lambda cfg, layout: build_store_connector(cfg.kv_role, layout, s.connect, 1),
    )
    yield s
    unregister_connector("dict-store")


def make_sides(role: str) -> tuple[KVConnectorScheduler, KVConnectorWorker, torch.Tensor]:
    pair = create_connector(KVTransferConfig(kv_connector="dict-store", kv_role=role), LAYOUT)
    assert pair is not None
    sched_side, worker = pair
    kv = torch.randn(8, *LAYOUT.block_shape)
    worker.register_kv_caches(kv)
    return sched_side, worker, kv


def finished_prefill(rid: str = "p") -> Request:
    req = Request(rid, PROMPT, SamplingParams(max_tokens=1))
    req.num_computed_tokens = len(PROMPT)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return req


def test_publish_then_load_with_a_miss(store: DictBlockStore) -> None:
    producer, p_worker, p_kv = make_sides("kv_producer")
    events = Recorder()
    p_worker.set_listener(events)
    try:
        assert producer.request_finished(finished_prefill(), [3, 1, 4])  # keep the blocks
        wait_until(lambda: "p" in events.saves, 30, "the save")
        assert events.saves["p"].ok and events.saves["p"].num_stored == 3
        assert p_worker.has_pending()  # finished, not yet collected
        assert p_worker.get_finished() == ({"p"}, {})
        assert not p_worker.has_pending()
    finally:
        p_worker.shutdown()
    keys = LAYOUT.keys(prompt_block_hashes(PROMPT, BS))
    assert all(torch.equal(store.blocks[k], p_kv[b]) for k, b in zip(keys, [3, 1, 4], strict=True))
    assert store.closed

    consumer, c_worker, c_kv = make_sides("kv_consumer")
    c_worker.set_listener(events)
    try:
        req = Request("d", PROMPT, SamplingParams(max_tokens=4))
        req.kv_transfer_params = KVTransferParams(
            tuple(prompt_block_hashes(PROMPT, BS)), LAYOUT.fingerprint
        )
        assert consumer.get_num_new_matched_tokens(req, 0) == len(PROMPT)
        del store.blocks[keys[1]]  # gone between the prefill and the load: a real miss
        consumer.update_state_after_alloc(req, [5, 6, 7], len(PROMPT))
        c_worker.start_load_kv(consumer.build_connector_meta(SchedulerOutput()))
        wait_until(lambda: "d" in events.loads, 30, "the load")
        result = events.loads["d"]
        assert (result.num_tokens, result.num_requested_tokens) == (BS, len(PROMPT))
        assert not result.complete and result.num_bytes == LAYOUT.block_bytes
        assert torch.equal(c_kv[5], p_kv[3])
        assert c_worker.num_load_failures == 1
        assert c_worker.get_finished() == (set(), {"d": BS})
    finally:
        c_worker.shutdown()


def test_a_failed_publish_is_reported_and_frees_the_blocks(store: DictBlockStore) -> None:
    producer, worker, _ = make_sides("kv_producer")
    events = Recorder()
    worker.set_listener(events)
    store.fail_puts = True
    try:
        assert producer.request_finished(finished_prefill(), [0, 1, 2])
        wait_until(lambda: "p" in events.saves, 30, "the save")
        assert not events.saves["p"].ok and "store down" in (events.saves["p"].error or "")
        assert worker.get_finished() == ({"p"}, {})
    finally:
        worker.shutdown()


def test_the_consumer_ignores_blocks_of_another_layout(store: DictBlockStore) -> None:
    consumer, worker, _ = make_sides("kv_consumer")
    try:
        req = Request("d", PROMPT, SamplingParams(max_tokens=4))
        assert consumer.get_num_new_matched_tokens(req, 0) == 0  # nothing remote
        req.kv_transfer_params = KVTransferParams(
            tuple(prompt_block_hashes(PROMPT, BS)), b"another-layout"
        )
        assert consumer.get_num_new_matched_tokens(req, 0) == 0
        assert consumer.build_connector_meta(SchedulerOutput()) is None
        assert not worker.has_pending()
    finally:
        worker.shutdown()


def test_an_aborted_prefill_publishes_nothing(store: DictBlockStore) -> None:
    producer, worker, _ = make_sides("kv_producer")
    try:
        req = finished_prefill()
        req.status = RequestStatus.FINISHED_ABORTED
        assert not producer.request_finished(req, [0, 1, 2])
        assert not worker.has_pending() and store.blocks == {}
    finally:
        worker.shutdown()


def test_store_connector_config_is_typed_and_checked() -> None:
    """Regression: the connector's settings were an untyped dict (test callables too)."""
    with pytest.raises(ValueError, match="connector_config must be a StoreConnectorConfig"):
        create_store_connector(KVTransferConfig(kv_connector="store"), LAYOUT)
    with pytest.raises(ValueError, match="connector_config must be a StoreConnectorConfig"):
        create_store_connector(
            KVTransferConfig(kv_connector="store", connector_config=KVConnectorConfig()), LAYOUT
        )
    with pytest.raises(ValueError, match="redis_url"):
        StoreConnectorConfig(redis_url="")
    with pytest.raises(ValueError, match="kvstore_address"):
        StoreConnectorConfig(redis_url="redis://x", kvstore_address="no-port")
    with pytest.raises(ValueError, match="num_transfer_threads"):
        StoreConnectorConfig(redis_url="redis://x", num_transfer_threads=0)
    with pytest.raises(ValueError, match="kvstore_timeout_s"):
        StoreConnectorConfig(redis_url="redis://x", kvstore_timeout_s=0)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):  # function-level imports too
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_engine_and_the_servicers_import_no_concrete_connector() -> None:
    """Regression: engine_core imported kvstore.keys (a cycle with kvstore importing the
    engine), and the servicers and ServiceContext imported (and isinstance-checked) the
    store connector. The engine finds it by name; the services use its interface."""
    root = Path(__file__).resolve().parents[2]
    files = [*sorted((root / "engine").rglob("*.py")), *(
        root / "services" / p
        for p in ("common/context.py", "prefill/servicer.py", "decode/servicer.py")
    )]
    offenders = {
        str(f.relative_to(root)): sorted(m for m in _imported_modules(f)
                                         if m.startswith("tandem.kvstore"))
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_the_service_flags_build_the_typed_store_config_once() -> None:
    from tandem.services.common.server import build_engine_config, build_parser

    ns = build_parser("tandem decode", "decode").parse_args(
        ["--redis-url", "redis://h:6379", "--kvstore", "h:7000"]
    )
    assert build_engine_config(ns, "decode").kv_transfer == KVTransferConfig(
        kv_connector="store",
        kv_role="kv_consumer",
        connector_config=StoreConnectorConfig("redis://h:6379", kvstore_address="h:7000"),
    )
    ns = build_parser("tandem serve", None).parse_args(["--role", "both"])
    assert build_engine_config(ns, "both").kv_transfer == KVTransferConfig()


def test_the_store_tier_flags() -> None:
    from tandem.services.common.server import build_engine_config, build_parser

    parser = build_parser("tandem decode", "decode")
    ns = parser.parse_args(["--redis-url", "redis://h:6379", "--kv-publish-output=false",
                            "--kv-load-from-store", "off"])
    config = build_engine_config(ns, "decode").kv_transfer.connector_config
    assert isinstance(config, StoreConnectorConfig)
    assert (config.publish_output, config.load_from_store) == (False, False)
    ns = parser.parse_args(["--redis-url", "redis://h:6379"])
    config = build_engine_config(ns, "decode").kv_transfer.connector_config
    assert (config.publish_output, config.load_from_store) == (True, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-publish-output=maybe"])
    with pytest.raises(ValueError, match="lookup_timeout_s"):
        StoreConnectorConfig(redis_url="redis://x", lookup_timeout_s=0)


def test_a_sharded_cache_moves_in_chunks_and_a_miss_stops_the_load(
    store: DictBlockStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged path (a TP=2 cache of LAYOUT's one KV head: replicated): a transfer
    larger than the staging buffer moves in chunks, and a miss in a later chunk loads
    the leading blocks only."""
    monkeypatch.setattr(connector_transfers, "STAGING_BYTES", 2 * LAYOUT.block_bytes)
    events = Recorder()
    ref = torch.randn(8, *LAYOUT.block_shape)
    prompt = list(range(5 * BS))  # 5 full blocks: chunks of 2, 2, 1
    pair = create_connector(KVTransferConfig(kv_connector="dict-store", kv_role="kv_producer"),
                            LAYOUT)
    assert pair is not None
    producer, p_worker = pair
    p_worker.register_kv_caches(split(ref, 2, 1))
    p_worker.set_listener(events)
    req = Request("p", prompt, SamplingParams(max_tokens=1))
    req.num_computed_tokens, req.status = len(prompt), RequestStatus.FINISHED_LENGTH_CAPPED
    try:
        assert producer.request_finished(req, [7, 0, 1, 2, 5])
        wait_until(lambda: "p" in events.saves, 30, "the save")
        assert events.saves["p"].num_stored == 5
    finally:
        p_worker.shutdown()
    keys = LAYOUT.keys(prompt_block_hashes(prompt, BS))
    assert all(torch.equal(store.blocks[k], ref[b])
               for k, b in zip(keys, [7, 0, 1, 2, 5], strict=True))

    del store.blocks[keys[3]]
    consumer, c_worker, _ = make_sides("kv_consumer")
    c_worker.register_kv_caches(dst := split(torch.zeros_like(ref), 2, 1))
    c_worker.set_listener(events)
    try:
        d = Request("d", prompt, SamplingParams(max_tokens=4))
        d.kv_transfer_params = KVTransferParams(tuple(prompt_block_hashes(prompt, BS)),
                                                LAYOUT.fingerprint)
        assert consumer.get_num_new_matched_tokens(d, 0) == len(prompt)
        consumer.update_state_after_alloc(d, [3, 4, 5, 6, 7], len(prompt))
        c_worker.start_load_kv(consumer.build_connector_meta(SchedulerOutput()))
        wait_until(lambda: "d" in events.loads, 30, "the load")
        assert events.loads["d"].num_tokens == 3 * BS
        assert events.loads["d"].num_bytes == 3 * LAYOUT.block_bytes
    finally:
        c_worker.shutdown()
    expect = torch.zeros_like(ref)
    expect[[3, 4, 5]] = ref[[7, 0, 1]]
    assert_shards_hold(dst, expect)


def test_a_cache_of_another_layout_is_rejected(store: DictBlockStore) -> None:
    _, worker, _ = make_sides("kv_consumer")
    try:
        with pytest.raises(ValueError, match="dtype torch.float32"):
            worker.register_kv_caches(torch.zeros(8, *LAYOUT.block_shape, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"full block must be \(2, 2, 4, 1, 2\)"):
            worker.register_kv_caches(split(torch.zeros(8, 4, 2, BS, 1, 2), 1, 2))
    finally:
        worker.shutdown()


def test_the_load_wait_and_store_timeout_flags() -> None:
    from tandem.services.common.server import build_engine_config, build_parser

    parser = build_parser("tandem decode", "decode")
    ns = parser.parse_args(["--redis-url", "redis://h:6379", "--kv-load-wait-s", "0.5",
                            "--kvstore-timeout-s", "1.5"])
    config = build_engine_config(ns, "decode").kv_transfer.connector_config
    assert isinstance(config, StoreConnectorConfig) and config.kv_load_wait_s == 0.5
    assert config.kvstore_timeout_s == 1.5
    ns = parser.parse_args(["--redis-url", "redis://h:6379"])
    config = build_engine_config(ns, "decode").kv_transfer.connector_config
    assert isinstance(config, StoreConnectorConfig) and config.kv_load_wait_s == 5.0
    assert config.kvstore_timeout_s == 10.0
    with pytest.raises(ValueError, match="kvstore_timeout_s"):
        build_engine_config(parser.parse_args(["--redis-url", "redis://h:6379",
                                               "--kvstore-timeout-s", "0"]), "decode")
    with pytest.raises(ValueError, match="kv_load_wait_s"):
        StoreConnectorConfig(redis_url="redis://x", kv_load_wait_s=-1)


def test_the_cache_kind_picks_the_transfer_path(store: DictBlockStore) -> None:
    """One CPU tensor moves in place, TP shards through (pageable) host staging: the
    plan of kvstore/transfer_path.py is what the transfer threads follow."""
    from tandem.kvstore.transfer_path import KVTransferPath

    _, worker, kv = make_sides("kv_consumer")
    transfers = worker._transfers  # type: ignore[attr-defined]
    try:
        assert transfers.plan.path is KVTransferPath.IN_PLACE
        assert transfers.kv_cache is kv and transfers.sharded is None
        worker.register_kv_caches(split(torch.zeros_like(kv), 2, 1))
        assert (transfers.plan.path, transfers.plan.pinned) == (KVTransferPath.HOST_STAGING,
                                                                False)
        assert transfers.kv_cache is None and transfers.sharded is not None
    finally:
        worker.shutdown()
