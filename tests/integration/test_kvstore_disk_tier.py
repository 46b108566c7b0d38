"""A store node's disk tier end to end: real redis-server, real `tandem kvstore` nodes in
subprocesses with ``--disk-path``, the real client (checksums verified on every get).

Faults are caused for real: a block file truncated on disk, a file-size limit set on the
node process (``prlimit``: its writes fail with EFBIG, as on a full device), a disk
capacity smaller than a block, a path that cannot be a directory.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from kvstore_harness import StoreNodeProcess, poll
from prometheus_client.parser import text_string_to_metric_families

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore.client import ClientOptions, KVStoreClient
from tandem.kvstore.disk_file import block_path
from tandem.kvstore.index import IndexEntry

pytest.importorskip("ucxx")

LAYOUT = KVCacheLayout(
    "tiny-disk", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16
)
BLOCK = LAYOUT.block_bytes
RAM_BLOCKS = 4


@pytest.fixture(scope="module")
def store_url(redis_url: str) -> str:
    # NOTE: a database of its own: other modules' nodes and keys stay invisible.
    return redis_url.rsplit("/", 1)[0] + "/7"


@pytest.fixture(params=["shm", "ucx"])
def read_path(request: pytest.FixtureRequest) -> str:
    """How gets read the node: its shared-memory pool, or UCX."""
    return request.param


def blocks_of(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(-32768, 32767, LAYOUT.block_shape, generator=g, dtype=torch.int16).view(
            torch.bfloat16
        )
        for _ in range(n)
    ]


def keys_of(tag: str, n: int) -> list[BlockKey]:
    import hashlib

    return LAYOUT.keys([hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)])


def metric(node: StoreNodeProcess, name: str, **labels: str) -> float:
    """A sample of the node's /metrics (0 when absent)."""
    for fam in text_string_to_metric_families(node.metrics_text()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def tiers(store_url: str, keys: list[BlockKey]) -> list[str | None]:
    """Which tier the index places each key in (``None``: not indexed)."""
    r = redis.Redis.from_url(store_url)
    try:
        entries = [IndexEntry.decode(r.get(k.redis_key)) for k in keys]
    finally:
        r.close()
    return [e.tier if e else None for e in entries]


def start_node(
    store_url: str, node_id: str, disk: Path, logs: Path, disk_capacity: int = 64 * BLOCK
) -> StoreNodeProcess:
    return StoreNodeProcess(
        store_url,
        node_id,
        RAM_BLOCKS * BLOCK,
        log_dir=logs,
        extra_args=("--disk-path", str(disk), "--disk-capacity", str(disk_capacity)),
    )


def client_for(store_url: str, node: StoreNodeProcess, read_path: str) -> KVStoreClient:
    return KVStoreClient(
        store_url,
        local_node=node.address,
        timeout_s=10,
        options=ClientOptions(shm=read_path == "shm"),
    )


def get_equal(c: KVStoreClient, keys: list[BlockKey], blocks: list[torch.Tensor]) -> int:
    """Get ``keys`` (at most RAM_BLOCKS at a time); the count of leading blocks loaded,
    each asserted bit-equal to what was put."""
    out = [torch.empty_like(b) for b in blocks]
    n = 0
    for i in range(0, len(keys), RAM_BLOCKS):
        got = c.get_blocks(keys[i : i + RAM_BLOCKS], out[i : i + RAM_BLOCKS])
        n += got
        if got < len(keys[i : i + RAM_BLOCKS]):
            break
    for a, b in zip(out[:n], blocks[:n], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    return n


def fill(
    c: KVStoreClient, node: StoreNodeProcess, keys: list[BlockKey], blocks: list[torch.Tensor]
) -> None:
    """Put blocks one at a time (the earliest evicted to disk), then wait until every
    evicted one's file is written."""
    for k, b in zip(keys, blocks, strict=True):
        assert c.put_blocks([k], [b]) == 1
    evicted = len(keys) - RAM_BLOCKS
    poll(lambda: metric(node, "tandem:kvstore_disk_write_bytes_total") >= evicted * BLOCK)


def test_blocks_evicted_from_ram_are_served_from_disk(
    store_url: str, tmp_path: Path, read_path: str
) -> None:
    node = start_node(store_url, f"disk-{read_path}", tmp_path / "disk", tmp_path)
    c = client_for(store_url, node, read_path)
    try:
        node.wait_ready(c)
        keys, blocks = keys_of(f"evict-{read_path}", 12), blocks_of(12, 1)
        fill(c, node, keys, blocks)
        assert tiers(store_url, keys) == ["disk"] * 8 + ["ram"] * 4
        assert metric(node, "tandem:kvstore_tier_blocks", tier="disk") == 8
        assert metric(node, "tandem:kvstore_tier_blocks", tier="ram") == RAM_BLOCKS
        assert len(list((tmp_path / "disk").glob("*/*.kvb"))) == 8

        # four at a time: reading keys 0-3 back moves keys 8-11 out of RAM, so every
        # batch is read back from disk (keys 8-11 from their files or, while those are
        # being written, from the write queue)
        assert get_equal(c, keys, blocks) == 12
        assert metric(node, "tandem:kvstore_tier_hits_total", tier="disk") == 12
        assert metric(node, "tandem:kvstore_tier_hits_total", tier="ram") == 0
        assert metric(node, "tandem:kvstore_disk_read_latency_seconds_count") >= 8
        assert tiers(store_url, keys) == ["disk"] * 8 + ["ram"] * 4
        # blocks read back keep their files: going out of RAM again writes nothing
        poll(lambda: metric(node, "tandem:kvstore_disk_write_bytes_total") == 12 * BLOCK)
        assert get_equal(c, keys[8:], blocks[8:]) == 4
        assert metric(node, "tandem:kvstore_tier_hits_total", tier="ram") == 4
        assert c.lookup(keys) == 12
    finally:
        c.close()
        node.stop()


def test_concurrent_gets_of_one_disk_block_both_get_it(store_url: str, tmp_path: Path) -> None:
    """A get that finds a block being read back by another waits for that read (the
    block's RAM entry is pending until it lands), never a miss."""
    import threading

    node = start_node(store_url, "concurrent", tmp_path / "disk", tmp_path)
    clients = [client_for(store_url, node, p) for p in ("shm", "ucx", "shm", "ucx")]
    try:
        node.wait_ready(clients[0])
        keys, blocks = keys_of("concurrent", 8), blocks_of(8, 6)
        fill(clients[0], node, keys, blocks)
        got: list[int] = []
        start = threading.Barrier(len(clients))

        def read(c: KVStoreClient) -> None:
            start.wait()
            got.append(get_equal(c, keys[:4], blocks[:4]))

        threads = [threading.Thread(target=read, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == [4] * len(clients)
        assert metric(node, "tandem:kvstore_tier_hits_total", tier="disk") == 4
    finally:
        for c in clients:
            c.close()
        node.stop()


def test_restart_on_the_same_directory_keeps_the_blocks(store_url: str, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    node = start_node(store_url, "restart-a", disk, tmp_path)
    c = client_for(store_url, node, "shm")
    keys, blocks = keys_of("restart", 10), blocks_of(10, 2)
    try:
        node.wait_ready(c)
        fill(c, node, keys, blocks)
    finally:
        node.stop()  # a clean stop withdraws its index entries
    try:
        assert c.lookup(keys) == 0
        again = start_node(store_url, "restart-b", disk, tmp_path)
        try:
            again.wait_ready(c)
            # what was on disk is indexed again (the RAM blocks of the first run are gone)
            assert tiers(store_url, keys) == ["disk"] * 6 + [None] * 4
            assert metric(again, "tandem:kvstore_tier_blocks", tier="disk") == 6
            assert get_equal(c, keys[:6], blocks[:6]) == 6
        finally:
            again.stop()
    finally:
        c.close()


def test_truncated_block_files_are_misses_and_counted(store_url: str, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    node = start_node(store_url, "trunc-a", disk, tmp_path)
    c = client_for(store_url, node, "ucx")
    keys, blocks = keys_of("trunc", 10), blocks_of(10, 3)
    try:
        node.wait_ready(c)
        fill(c, node, keys, blocks)
        # cut while the node runs: the get that reads it back finds it short
        path = block_path(disk, keys[0].redis_key)
        path.write_bytes(path.read_bytes()[:-100])
        assert c.get_blocks(keys[:1], [torch.empty_like(blocks[0])]) == 0
        poll(
            lambda: (
                metric(node, "tandem:kvstore_disk_corrupt_blocks_total", reason="truncated") == 1
            )
        )
        poll(lambda: tiers(store_url, keys[:1]) == [None])
        assert not path.exists()
    finally:
        node.stop()
    # cut while the node is down: the restarted node's scan drops it
    path = block_path(disk, keys[1].redis_key)
    path.write_bytes(path.read_bytes()[: BLOCK // 2])
    again = start_node(store_url, "trunc-b", disk, tmp_path)
    try:
        again.wait_ready(c)
        assert metric(again, "tandem:kvstore_disk_corrupt_blocks_total", reason="truncated") == 1
        assert tiers(store_url, keys[1:6]) == [None] + ["disk"] * 4
        assert get_equal(c, keys[2:6], blocks[2:6]) == 4
    finally:
        c.close()
        again.stop()


def test_failed_disk_writes_degrade_to_ram_only(store_url: str, tmp_path: Path) -> None:
    node = start_node(store_url, "efbig", tmp_path / "disk", tmp_path)
    c = client_for(store_url, node, "shm")
    try:
        node.wait_ready(c)
        # every file the node writes from now on stops at 1 KiB: EFBIG, as a full device
        resource.prlimit(node.proc.pid, resource.RLIMIT_FSIZE, (1024, 1024))
        keys, blocks = keys_of("efbig", 8), blocks_of(8, 4)
        for k, b in zip(keys, blocks, strict=True):
            assert c.put_blocks([k], [b]) == 1  # never an error to the request
        poll(lambda: metric(node, "tandem:kvstore_disk_write_errors_total") >= 1)
        assert metric(node, "tandem:kvstore_disk_degraded") == 1
        poll(lambda: tiers(store_url, keys[:4]) == [None] * 4)
        assert metric(node, "tandem:kvstore_disk_dropped_total", reason="degraded") >= 1
        assert not list((tmp_path / "disk").glob("*/*"))  # no partial file left
        assert get_equal(c, keys[4:], blocks[4:]) == 4
    finally:
        c.close()
        node.stop()


def test_disk_smaller_than_a_block_keeps_ram_serving(store_url: str, tmp_path: Path) -> None:
    node = start_node(store_url, "tiny-disk", tmp_path / "disk", tmp_path, disk_capacity=1024)
    c = client_for(store_url, node, "ucx")
    try:
        node.wait_ready(c)
        keys, blocks = keys_of("tiny", 6), blocks_of(6, 5)
        for k, b in zip(keys, blocks, strict=True):
            assert c.put_blocks([k], [b]) == 1
        assert metric(node, "tandem:kvstore_disk_dropped_total", reason="full") == 2
        assert tiers(store_url, keys) == [None] * 2 + ["ram"] * 4
        assert get_equal(c, keys[2:], blocks[2:]) == 4
    finally:
        c.close()
        node.stop()


@pytest.mark.parametrize("case", ["not_a_directory", "no_room"])
def test_unusable_disk_path_fails_at_start_naming_it(
    store_url: str, tmp_path: Path, case: str
) -> None:
    (tmp_path / "file").write_text("x")
    disk = tmp_path / "file" / "disk" if case == "not_a_directory" else tmp_path / "disk"
    capacity = "64M" if case == "not_a_directory" else "1000000T"
    out = subprocess.run(
        [
            sys.executable,
            "-P",
            "-m",
            "tandem.kvstore.server",
            "--listen",
            "127.0.0.1:1",
            "--capacity",
            "1M",
            "--redis-url",
            store_url,
            "--disk-path",
            str(disk),
            "--disk-capacity",
            capacity,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem kvstore: error: --disk-path "), lines
    assert str(disk) in lines[0]
    assert ("not a writable directory" if case == "not_a_directory" else "room") in lines[0]
