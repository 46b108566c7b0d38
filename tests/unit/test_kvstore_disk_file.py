"""The disk tier's block files (kvstore/disk_file.py), directory scan and start-up probe
(kvstore/disk_scan.py), and the node's disk settings (NodeConfig): real files in a
temporary directory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash

from tandem.kvstore.config import NodeConfig
from tandem.kvstore.disk_file import (
    HEADER,
    BlockFileError,
    BlockHeader,
    block_path,
    read_block_into,
    verify_file,
    write_block,
)
from tandem.kvstore.disk_scan import probe_directory, scan_directory

KEY = "tandem:kv:blk:" + "ab" * 16 + ":" + "cd" * 32


def block(seed: int, n: int = 4096) -> tuple[BlockHeader, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    key = KEY[:-2] + f"{seed:02x}"
    return BlockHeader(key, n, xxhash.xxh3_64_hexdigest(data.data)), data


def test_a_written_block_reads_back_equal_and_verified(tmp_path: Path) -> None:
    header, data = block(1)
    size = write_block(tmp_path, header, data.tobytes())
    path = block_path(tmp_path, header.key)
    assert path.stat().st_size == size == HEADER.size + len(header.key) + data.nbytes
    assert path.parent.parent == tmp_path and not list(tmp_path.glob("*/*.tmp"))
    out = np.empty_like(data)
    read_block_into(path, header.key, out)
    assert np.array_equal(out, data)
    assert verify_file(path) == (header, size)


@pytest.mark.parametrize(
    ("cut", "reason"), [(-1, "truncated"), (HEADER.size - 2, "truncated"), (None, "checksum")]
)
def test_a_damaged_file_is_refused_with_its_reason(
    tmp_path: Path, cut: int | None, reason: str
) -> None:
    header, data = block(2)
    write_block(tmp_path, header, data.tobytes())
    path = block_path(tmp_path, header.key)
    raw = bytearray(path.read_bytes())
    if cut is None:
        raw[-1] ^= 0xFF
    else:
        del raw[cut:]
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockFileError) as info:
        verify_file(path)
    assert info.value.reason == reason
    with pytest.raises(BlockFileError) as info:
        read_block_into(path, header.key, np.empty_like(data))
    assert info.value.reason == reason


def test_a_file_of_another_key_or_size_is_refused(tmp_path: Path) -> None:
    header, data = block(3)
    write_block(tmp_path, header, data.tobytes())
    path = block_path(tmp_path, header.key)
    with pytest.raises(BlockFileError, match="not"):
        read_block_into(path, block(4)[0].key, np.empty_like(data))
    with pytest.raises(BlockFileError) as info:
        read_block_into(path, header.key, np.empty(100, dtype=np.uint8))
    assert info.value.reason == "header"
    path.write_bytes(b"XXXX" + path.read_bytes()[4:])
    with pytest.raises(BlockFileError) as info:
        verify_file(path)
    assert info.value.reason == "header"


def test_scan_keeps_good_files_oldest_first_and_drops_the_rest(tmp_path: Path) -> None:
    import os

    good = [block(i) for i in range(3)]
    for i, (h, d) in enumerate(good):
        write_block(tmp_path, h, d.tobytes())
        os.utime(block_path(tmp_path, h.key), (1000 + i, 1000 + i))
    bad_header, bad = block(9)
    write_block(tmp_path, bad_header, bad.tobytes())
    bad_path = block_path(tmp_path, bad_header.key)
    bad_path.write_bytes(bad_path.read_bytes()[:-10])
    leftover = bad_path.with_name("x.tmp")
    leftover.write_bytes(b"half a write")

    found = scan_directory(tmp_path)
    assert [h.key for h, _ in found.blocks] == [h.key for h, _ in good]
    assert found.corrupt == {"truncated": 1}
    assert found.num_temp_removed == 1
    assert not bad_path.exists() and not leftover.exists()


def test_probe_names_a_path_that_cannot_be_written_or_lacks_room(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--disk-path .*file/d is not a writable directory"):
        probe_directory(tmp_path / "file" / "d", 1 << 20)
    with pytest.raises(ValueError, match=r"--disk-path .* less than --disk-capacity"):
        probe_directory(tmp_path / "d", 1 << 60)
    probe_directory(tmp_path / "d", 1 << 20)
    assert (tmp_path / "d").is_dir() and not list((tmp_path / "d").iterdir())


def node_config(**kw: object) -> NodeConfig:
    return NodeConfig(
        host="127.0.0.1",
        port=1,
        capacity_bytes=1 << 20,
        redis_url="redis://127.0.0.1:1/0",
        node_id="n",
        metrics_port=0,
        **kw,
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"disk_path": "/tmp/x"}, "disk_capacity_bytes"),
        ({"disk_capacity_bytes": 1 << 20}, "disk_path"),
        ({"disk_path": "/tmp/x", "disk_capacity_bytes": 1, "block_ttl_s": 5.0}, "block_ttl_s"),
        (
            {"disk_path": "/tmp/x", "disk_capacity_bytes": 1, "disk_write_queue_bytes": 0},
            "disk_write_queue_bytes",
        ),
        # Bug: without a disk tier a negative --disk-write-queue-bytes was accepted silently
        ({"disk_write_queue_bytes": -1}, "disk_write_queue_bytes"),
    ],
)
def test_disk_settings_are_checked_by_name(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        node_config(**kw)
