"""The shared-memory pool segment and its client mapping (kvstore/shm.py), no node."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tandem.kvstore.pool import SlotPool
from tandem.kvstore.shm import Mapping, Segment, host_id, shm_enabled_by_env

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
    seg.close()
    assert not os.path.exists(seg.path)
    with pytest.raises(OSError):
        Mapping(seg.path, seg.ident)
    # an existing mapping stays valid after the owner closed its file
    assert bytes(m.array[pool.offset(3):pool.offset(3) + 10]) == bytes(range(10))


def test_pool_rejects_a_short_buffer() -> None:
    with pytest.raises(ValueError, match="buffer"):
        SlotPool(1 << 20, buffer=np.zeros(1 << 10, dtype=np.uint8))


def test_host_id_and_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_id() == host_id() and host_id().count("/") >= 2
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv("TANDEM_KV_SHM", off)
        assert not shm_enabled_by_env()
    monkeypatch.setenv("TANDEM_KV_SHM", "1")
    assert shm_enabled_by_env()
    monkeypatch.delenv("TANDEM_KV_SHM")
    assert shm_enabled_by_env()


def test_split_shares_cuts_between_blocks_into_equal_bytes() -> None:
    from tandem.kvstore.aio_client import split_shares

    # two pieces of adjacent blocks, six blocks of one size, two threads
    assert split_shares([[0, 1, 2, 3], [4, 5]], [1] * 6, 2) == [[[0, 1, 2]], [[3], [4, 5]]]
    assert split_shares([[0, 1, 2, 3], [4, 5]], [1] * 6, 1) == [[[0, 1, 2, 3], [4, 5]]]
    # never more shares than blocks, none empty; a big block fills a share alone
    assert split_shares([[0, 1, 2]], [1, 1, 1], 4) == [[[0]], [[1]], [[2]]]
    assert split_shares([[0], [1, 2]], [8, 1, 1], 2) == [[[0]], [[1, 2]]]
    assert split_shares([], [], 2) == []
