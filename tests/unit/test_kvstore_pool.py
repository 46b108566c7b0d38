"""KV store pieces without I/O: the slot pool, message grouping, byte sizes (keys and
layouts: tests/unit/test_contracts_kv.py)."""

from __future__ import annotations

import time

import pytest

from tandem.kvstore.index import IndexEntry, commit_args
from tandem.kvstore.pool import PoolFullError, SlotPool
from tandem.kvstore.protocol import adjacent_runs, decode, encode, group_messages, make_tag
from tandem.kvstore.server import parse_bytes


def test_lru_eviction_skips_pinned_and_pending_blocks() -> None:
    pool = SlotPool(3 * 100)
    entries = []
    for k in "abc":
        e, gone = pool.allocate(k, 100, "x", None)
        assert gone == []
        pool.commit(e)
        entries.append(e)
    assert pool.lru_keys() == ["a", "b", "c"]
    read = pool.acquire("a")  # a is now most recent and pinned
    assert read is not None and pool.lru_keys() == ["b", "c", "a"]
    e, gone = pool.allocate("d", 100, "x", None)
    assert [g.key for g in gone] == ["b"]
    pool.commit(e)
    # c is LRU, then a (pinned), then d
    e2, gone = pool.allocate("e", 100, "x", None)
    assert [g.key for g in gone] == ["c"]
    # a pinned by the read, e pending: only d can go
    e3, gone = pool.allocate("f", 100, "x", None)
    assert [g.key for g in gone] == ["d"]
    with pytest.raises(PoolFullError):
        pool.allocate("g", 100, "x", None)
    pool.release(read)
    pool.commit(e2)
    pool.abort(e3)
    assert pool.acquire("f") is None
    assert pool.num_evictions == 3


def test_slot_size_is_fixed_by_the_first_block() -> None:
    pool = SlotPool(1000)
    e, _ = pool.allocate("a", 200, "x", None)
    assert pool.slot_bytes == 200 and pool.num_slots == 5
    pool.allocate("b", 150, "x", None)  # smaller blocks fit a slot
    with pytest.raises(ValueError, match="does not fit"):
        pool.allocate("c", 201, "x", None)
    with pytest.raises(ValueError, match="larger than the node capacity"):
        SlotPool(100).allocate("a", 101, "x", None)


def test_ttl_expiry() -> None:
    pool = SlotPool(1000, slot_bytes=100)
    e, _ = pool.allocate("a", 100, "x", ttl_s=0.01)
    pool.commit(e)
    e, _ = pool.allocate("b", 100, "x", ttl_s=None)
    pool.commit(e)
    deadline = time.monotonic() + 5
    while pool.acquire("a") is not None:
        assert time.monotonic() < deadline
        pool.release(pool.entries["a"])
    assert [x.key for x in pool.expire()] == ["a"]
    assert pool.lru_keys() == ["b"]


def test_message_grouping() -> None:
    # client runs [0..3] and [4..5]; slots 7,8,9 consecutive then 2; block 5 absent
    runs = [[0, 4], [4, 2]]
    slots = [7, 8, 9, 2, 3, None]
    sizes = [10, 10, 10, 10, 10, 0]
    assert group_messages(runs, slots, sizes, 10) == [(0, 3), (3, 1), (4, 1)]
    # a short block ends a message (its slot is not full)
    assert group_messages([[0, 3]], [0, 1, 2], [10, 5, 10], 10) == [(0, 2), (2, 1)]
    with pytest.raises(ValueError, match="outside the batch"):
        group_messages([[0, 9]], slots, sizes, 10)
    assert adjacent_runs([100, 110, 120, 200, 210], [10] * 5) == [[0, 3], [3, 2]]


def test_protocol_and_index_encodings() -> None:
    msg = {"op": "get", "keys": ["a"], "req": 5}
    assert decode(encode(msg)) == msg
    assert make_tag(1, 2, 3) == (1 << 48) | (2 << 24) | 3
    e = IndexEntry("node-1", 4, 100, "abcd")
    assert IndexEntry.decode(e.encode().encode()) == e
    assert IndexEntry.decode(b"garbage") is None
    keys, argv = commit_args([("k1", "n|1|")], [("k2", "v", 0)])
    assert keys == ["k1", "k2"] and argv == [1, "n|1|", "v", 0]


def test_parse_bytes() -> None:
    assert parse_bytes("1073741824") == 1 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("64K") == 64 << 10
    assert parse_bytes("1G") == 1 << 30
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_server_flags() -> None:
    from tandem.kvstore.server import config_from_args

    cfg = config_from_args(["--listen", "0.0.0.0:7000", "--capacity", "1GiB",
                            "--redis-url", "redis://r:6379", "--node-id", "a"])
    assert (cfg.host, cfg.port, cfg.capacity_bytes, cfg.node_id) == ("0.0.0.0", 7000, 1 << 30, "a")
    assert cfg.metrics_port == 7000 and cfg.prefault
    # ucxx's own variables are read here, at the node's edge, into the config
    cfg = config_from_args(["--listen", "h:1", "--capacity", "1K", "--redis-url", "r"],
                           environ={"UCXPY_PROGRESS_MODE": "thread-polling"})
    assert (cfg.ucx.progress_mode, cfg.ucx.python_future) == ("thread-polling", True)
    # --listen h:99999 was a traceback (OverflowError from the metrics server's bind)
    for bad in (["--listen", "nohost"], ["--listen", "h:99999"], ["--capacity", "0"]):
        args = ["--listen", "h:1", "--capacity", "1K", "--redis-url", "r"] + bad
        with pytest.raises(SystemExit):
            config_from_args(args)


def test_node_ids_that_would_break_index_entries_are_refused() -> None:
    # the node id is the first "|"-separated field of an index entry, and lookups
    # join entries with newlines: such an id made every block of the node a miss
    from tandem.kvstore.server import config_from_args

    for bad in ("a|b", "a b", "a\nb"):
        with pytest.raises(SystemExit):
            config_from_args(["--listen", "h:1", "--capacity", "1K", "--redis-url", "r",
                              "--node-id", bad])


def test_lookup_reply_parsing() -> None:
    from tandem.kvstore.index import parse_lookup

    e = IndexEntry("n1", 3, 100, "ab")
    node = ["n1", "127.0.0.1:7000", "ff00", "1024", "100", "256", "h/boot/pid:[1]",
            "/proc/7/fd/5", "1:2:1024"]
    entries, nodes = parse_lookup(3, [f"{e.encode()}\n\ngarbage".encode(),
                                      "\n".join(node).encode()])
    assert entries == [e, None, None] and nodes == [node]
    assert parse_lookup(1, [b"", b""]) == ([None], [])
    assert parse_lookup(0, [b"", b""]) == ([], [])
    with pytest.raises(ValueError, match="fields for 2 keys"):
        parse_lookup(2, [e.encode().encode(), b""])
    with pytest.raises(ValueError, match="node fields"):
        parse_lookup(1, [e.encode().encode(), b"n1\naddr"])
