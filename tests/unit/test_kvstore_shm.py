"""The shared-memory pool segment and its client mapping (kvstore/shm.py), no node."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tandem.kvstore.config import ClientOptions, UcxOptions
from tandem.kvstore.pool import SlotPool
from tandem.kvstore.shm import Mapping, Segment, host_id, segment_gone

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")


def test_segment_is_mapped_read_only_by_its_path_and_identity() -> None:
    seg = Segment("unit", 1 << 20)
    pool = SlotPool(1 << 20, 4096, buffer=seg.array)
    pool.view(3, 10)[:] = np.arange(10, dtype=np.uint8)
    assert not any("tandem" in f for f in os.listdir("/dev/shm"))  # nameless
    m = Mapping(seg.path, seg.ident)
    assert m.nbytes == 1 << 20
    assert bytes(m.array[pool.offset(3):pool.offset(3) + 10]) == bytes(range(10))
    with pytest.raises(ValueError, match="read-only"):
        m.array[0] = 1
    dev, ino, size = seg.ident.split(":")
    with pytest.raises(OSError, match="not the advertised segment"):
        Mapping(seg.path, f"{dev}:{int(ino) + 1}:{size}")
    with pytest.raises(OSError, match="not the advertised segment"):
        Mapping(seg.path, f"{dev}:{ino}:{2 << 20}")  # larger than the file
    assert not segment_gone(seg.path, seg.ident)
    assert segment_gone(seg.path, f"{dev}:{int(ino) + 1}:{size}")  # another file there
    assert not segment_gone(seg.path, "malformed")  # cannot tell: not gone
    seg.close()
    assert not os.path.exists(seg.path)
    assert segment_gone(seg.path, seg.ident)
    with pytest.raises(OSError):
        Mapping(seg.path, seg.ident)
    # an existing mapping stays valid after the owner closed its file
    assert bytes(m.array[pool.offset(3):pool.offset(3) + 10]) == bytes(range(10))


def test_pool_rejects_a_short_buffer() -> None:
    with pytest.raises(ValueError, match="buffer"):
        SlotPool(1 << 20, buffer=np.zeros(1 << 10, dtype=np.uint8))


def test_host_id() -> None:
    assert host_id() == host_id() and host_id().count("/") >= 2


def test_client_options_down_node_retry_must_be_positive() -> None:
    assert ClientOptions().down_node_retry_s > 0
    with pytest.raises(ValueError, match="down_node_retry_s"):
        ClientOptions(down_node_retry_s=0)


def test_client_options_are_read_from_the_environment_given() -> None:
    """The entry points read the variables once (kvstore/config.py); nothing in the
    client reads os.environ (before: kvstore/shm.py and aio_client.py did, per client)."""
    for off in ("0", "false", "No", "off"):
        assert not ClientOptions.from_environ({"TANDEM_KV_SHM": off}).shm
    assert ClientOptions.from_environ({"TANDEM_KV_SHM": "1"}).shm
    assert ClientOptions.from_environ({}) == ClientOptions()
    assert ClientOptions.from_environ({"TANDEM_KV_COPY_THREADS": "3"}).copy_threads == 3
    with pytest.raises(ValueError, match="TANDEM_KV_COPY_THREADS"):
        ClientOptions.from_environ({"TANDEM_KV_COPY_THREADS": "many"})
    with pytest.raises(ValueError, match="copy_threads"):
        ClientOptions(copy_threads=0)
    # ucxx's own variables: the progress mode, Python futures only with a thread mode
    assert UcxOptions.from_environ({}) == UcxOptions("thread", True)
    assert UcxOptions.from_environ({"UCXPY_ENABLE_PYTHON_FUTURE": "0"}).python_future is False
    assert UcxOptions.from_environ({"UCXPY_PROGRESS_MODE": "polling"}) == \
        UcxOptions("polling", False)
    with pytest.raises(ValueError, match="progress_mode"):
        UcxOptions.from_environ({"UCXPY_PROGRESS_MODE": "busy"})


def test_no_client_module_reads_the_environment() -> None:
    """Configuration arrives at the edge (config objects passed in), never by
    os.environ reads inside the store's client, node or UCX seam."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "kvstore"
    for name in ("aio_client.py", "client.py", "shm.py", "shm_read.py", "ucx_read.py",
                 "transport.py", "node.py", "ucx.py"):
        text = (root / name).read_text()
        reads = [line for line in text.splitlines()
                 if ("os.environ" in line or "getenv" in line) and "setdefault" not in line]
        assert reads == [], f"{name} reads the environment: {reads}"


def test_split_shares_cuts_between_blocks_into_equal_bytes() -> None:
    from tandem.kvstore.shm_read import split_shares

    # two pieces of adjacent blocks, six blocks of one size, two threads
    assert split_shares([[0, 1, 2, 3], [4, 5]], [1] * 6, 2) == [[[0, 1, 2]], [[3], [4, 5]]]
    assert split_shares([[0, 1, 2, 3], [4, 5]], [1] * 6, 1) == [[[0, 1, 2, 3], [4, 5]]]
    # never more shares than blocks, none empty; a big block fills a share alone
    assert split_shares([[0, 1, 2]], [1, 1, 1], 4) == [[[0]], [[1]], [[2]]]
    assert split_shares([[0], [1, 2]], [8, 1, 1], 2) == [[[0]], [[1, 2]]]
    assert split_shares([], [], 2) == []


def test_copy_blocks_takes_only_blocks_the_node_has_and_checksums_what_landed() -> None:
    """kvstore/shm_read.py's copy: absent blocks (-1), a size other than the view's and
    a span past the segment are skipped; the rest land (adjacent ones in one copy, also
    split between threads) with the checksum of their bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from tandem.kvstore.shm_read import copy_blocks
    from tandem.kvstore.transport import checksum

    seg = Segment("copy", 1 << 16)
    seg.array[:] = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    m = Mapping(seg.path, seg.ident)
    dst = np.zeros((6, 1024), dtype=np.uint8)
    views = list(dst)
    offsets = [0, 1024, 2048, -1, 8192, (1 << 16) - 512]
    sizes = [1024, 1024, 1024, 0, 512, 1024]
    with ThreadPoolExecutor(2) as pool:
        for pool_for in (lambda n: (None, 1), lambda n: (pool, 3)):
            dst[:] = 0
            sums = copy_blocks(m, offsets, sizes, views, pool_for)
            assert sorted(sums) == [0, 1, 2]  # 3 absent, 4 too short, 5 past the end
            for j in (0, 1, 2):
                assert bytes(dst[j]) == bytes(seg.array[offsets[j]:offsets[j] + 1024])
                assert sums[j] == checksum(dst[j])
            assert not dst[3:].any()
    seg.close()
