"""`tandem bench serve`'s KV store tier runs (bench/kvstore_disk.py): flag checks, the store
node's counters read from a real /metrics endpoint, the dd-style sequential read."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from ports import free_port
from prometheus_client import start_http_server

from tandem.bench.kvstore_disk import check_args, sequential_read, stack_fields, store_counters
from tandem.kvstore.metrics import NodeMetrics


def _args(**kw: object) -> argparse.Namespace:
    base = dict(
        launch=["disagg"],
        launch_kvstore_tiers=["ram", "disk"],
        launch_kvstore_capacity=16 << 20,
        launch_kvstore_disk_path="/tmp/kv",
        launch_kvstore_disk_capacity=1 << 30,
    )
    return argparse.Namespace(**(base | kw))


def test_tier_flags_are_checked_by_name() -> None:
    check_args(_args())
    with pytest.raises(ValueError, match="--launch-kvstore-disk-path"):
        check_args(_args(launch_kvstore_disk_path=None))
    with pytest.raises(ValueError, match="needs --launch"):
        check_args(_args(launch=[]))


def test_each_disk_run_gets_a_fresh_folder(tmp_path: Path) -> None:
    args = _args(launch_kvstore_disk_path=str(tmp_path))
    (tmp_path / "run-1").mkdir()
    (tmp_path / "run-1" / "old.kvb").write_text("x")
    assert stack_fields(args, "ram", 0) == {"kvstore_capacity_bytes": 16 << 20}
    fields = stack_fields(args, "disk", 1)
    assert fields["kvstore_disk_path"] == str(tmp_path / "run-1")
    assert fields["kvstore_disk_capacity_bytes"] == 1 << 30
    assert not (tmp_path / "run-1").exists()


def test_store_counters_per_tier_from_a_real_metrics_endpoint() -> None:
    m = NodeMetrics()
    m.tier_hits.labels("disk").inc(6)
    m.tier_hits.labels("ram").inc(4)
    m.disk_read_bytes.inc(6 << 20)
    m.disk_read_latency.observe(0.5)
    m.disk_read_latency.observe(0.5)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=m.registry)
    try:
        c = store_counters(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        thread.join()
    assert c["tier_hits_total{disk}"] == 6 and c["tier_hits_total{ram}"] == 4
    assert c["disk_read_bytes_per_s"] == 6 << 20


def test_sequential_read_measures_and_removes_its_file(tmp_path: Path) -> None:
    out = sequential_read(tmp_path, 8 << 20)
    assert out["probe_bytes"] == 8 << 20
    assert out["buffered_bytes_per_s"] > 0 and out["direct_bytes_per_s"] >= 0
    assert not list(tmp_path.iterdir())
