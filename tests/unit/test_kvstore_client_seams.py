"""The store client's seams, checked on its source (no Redis, no UCX)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KVSTORE = Path(__file__).resolve().parents[2] / "kvstore"


def test_the_blocking_facade_uses_only_public_members_of_the_async_core() -> None:
    """kvstore/client.py reaches the core only through ``self.aio`` / ``aio`` and never
    a private member of it (before: about twenty, e.g. ``aio._index``)."""
    tree = ast.parse((KVSTORE / "client.py").read_text())
    private = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        owner = node.value
        through_core = (isinstance(owner, ast.Name) and owner.id == "aio") or (
            isinstance(owner, ast.Attribute) and owner.attr in ("aio", "shm", "ucx", "conns"))
        if through_core:
            private.append(f"line {node.lineno}: .{node.attr}")
    assert private == []


def test_the_store_protocol_has_no_test_operation() -> None:
    """Faults are injected by tests through the node's segment (tests/integration/
    kvstore_harness.py), never by a request the production node serves (before: a
    ``corrupt`` op behind TANDEM_KVSTORE_TEST_HOOKS)."""
    for name in ("node.py", "protocol.py", "shm_ctl.py"):
        text = (KVSTORE / name).read_text()
        assert "corrupt" not in text and "TEST_HOOKS" not in text, name


def test_tally_counts_leading_intact_blocks_and_names_the_entries_to_remove() -> None:
    """Blocks missing on their node and the first one whose bytes fail their checksum
    end the count; their index entries are the ones to remove (and only those)."""
    import numpy as np

    from tandem.contracts.block_key import BlockKey
    from tandem.kvstore.aio_client import AsyncKVStoreClient
    from tandem.kvstore.config import ClientOptions
    from tandem.kvstore.index import IndexEntry
    from tandem.kvstore.transport import checksum

    core = AsyncKVStoreClient("redis://127.0.0.1:1/0", options=ClientOptions(shm=False))
    keys = [BlockKey(bytes([i]) * 32, b"f" * 16) for i in range(4)]
    views = [np.full(8, i, dtype=np.uint8) for i in range(4)]
    entries = [IndexEntry("n1", i, 8, checksum(v)) for i, v in enumerate(views)]
    # all arrived; block 2 not checked yet (UCX) and intact
    assert core.tally(keys, views, entries, 4, {0: True, 1: True, 2: None, 3: True}) == (4, [])
    # block 1 gone from its node, block 3 too: count stops at 1, both entries go
    count, stale = core.tally(keys, views, entries, 4, {0: True, 2: True})
    assert (count, [k for k, _ in stale]) == (1, [keys[1].redis_key, keys[3].redis_key])
    # block 1's bytes are bad (checked here): a miss, its entry goes, none after it checked
    bad = [*entries[:1], IndexEntry("n1", 1, 8, "0" * 16), *entries[2:]]
    count, stale = core.tally(keys, views, bad, 4, {0: True, 1: None, 2: False, 3: True})
    assert (count, [k for k, _ in stale]) == (1, [keys[1].redis_key])
    assert core.num_checksum_failures == 1
    # block 2's node is gone (down): a miss from there on, but its entry stays (the
    # node's heartbeat decides), and block 3's absence is not even looked at
    assert core.tally(keys, views, entries, 4, {0: True, 1: True}, {2, 3}) == (2, [])


def test_a_down_node_stays_down_for_its_back_off_or_until_it_restarts() -> None:
    from tandem.kvstore.index import IndexEntry
    from tandem.kvstore.index_entries import without_down
    from tandem.kvstore.transport import DownNodes, NodeInfo

    now = [100.0]
    down = DownNodes(2.0, clock=lambda: now[0])
    n1 = NodeInfo("n1", "h:1", b"worker-1", 1 << 20, 0)
    n2 = NodeInfo("n2", "h:2", b"worker-2", 1 << 20, 0)
    down.mark(n1, "connection reset")
    assert down.is_down(n1) and not down.is_down(n2)
    entries = [IndexEntry("n2", 0, 8, "a"), IndexEntry("n1", 1, 8, "b"), None]
    assert without_down(entries, {"n1": n1, "n2": n2}, down) == [entries[0], None, None]
    now[0] += 1.9
    assert down.is_down(n1)
    now[0] += 0.1
    assert not down.is_down(n1), "tried again after the back-off"
    down.mark(n1, "refused")
    restarted = NodeInfo("n1", "h:1", b"worker-1b", 1 << 20, 0)
    assert not down.is_down(restarted), "the registry shows it with a new worker"
    assert not down.is_down(n1), "forgotten once seen restarted"
    with pytest.raises(ValueError, match="retry_s"):
        DownNodes(0)
