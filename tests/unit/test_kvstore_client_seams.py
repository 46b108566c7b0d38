"""The store client's seams, checked on its source (no Redis, no UCX)."""

from __future__ import annotations

import ast
from pathlib import Path

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
