"""`tandem bench kvstore` bookkeeping with a fake store client (no Redis, no UCX)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest

from tandem.bench import kvstore as bench


class _FakeClient:
    """Stores nothing; ``get_blocks`` writes what ``write`` says into ``into``."""

    write = "copy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.blocks: dict[Any, np.ndarray] = {}

    def put_blocks(self, keys: list[Any], blocks: list[np.ndarray]) -> int:
        self.blocks.update(zip(keys, blocks, strict=True))
        return len(keys)

    def get_blocks(self, keys: list[Any], into: list[np.ndarray]) -> int:
        if self.write == "copy":
            for k, b in zip(keys, into, strict=True):
                np.copyto(b, self.blocks[k])
        return len(keys)

    def close(self) -> None:
        pass


def _run(monkeypatch: pytest.MonkeyPatch, write: str) -> list[dict[str, Any]]:
    import tandem.kvstore.client as client_mod
    import tandem.kvstore.ucx as ucx_mod

    monkeypatch.setattr(_FakeClient, "write", write)
    monkeypatch.setattr(client_mod, "KVStoreClient", _FakeClient)
    monkeypatch.setattr(client_mod, "wait_for_nodes", lambda *a, **k: None)
    monkeypatch.setattr(ucx_mod, "transports", lambda: "fake")
    args = argparse.Namespace(sizes="64K,256K", block_bytes="64K", iters=3, ucx_tls=None,
                              redis_url="redis://unused")
    return bench.run(args)


def test_records_and_memcpy_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    records = _run(monkeypatch, "copy")
    assert [(r["batch_bytes"], r["num_blocks"]) for r in records] == [(64 << 10, 1),
                                                                      (256 << 10, 4)]
    for r in records:
        assert r["memcpy_gbps"] > 0 and r["get_vs_memcpy"] == r["get_gbps"] / r["memcpy_gbps"]


def test_a_get_that_returns_wrong_bytes_fails_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    # the check used to run after the reference copy had already filled the
    # destination with the right bytes, so it could not fail
    with pytest.raises(AssertionError, match="other bytes"):
        _run(monkeypatch, "nothing")
