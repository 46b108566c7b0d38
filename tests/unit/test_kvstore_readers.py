"""The transport seam of the store client's reads (kvstore/readers.py): the registry builds
the readers the options allow, in the order tried, and a get reads each node through the
first reader that serves it (no Redis, no UCX: the index entries are given)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tandem.contracts.block_key import BlockKey
from tandem.kvstore.aio_client import AsyncKVStoreClient
from tandem.kvstore.config import ClientOptions
from tandem.kvstore.index import IndexEntry
from tandem.kvstore.readers import ReaderContext, make_readers, register_reader
from tandem.kvstore.shm_read import ShmReader
from tandem.kvstore.store import KVStoreNodeDownError
from tandem.kvstore.transport import NodeInfo, checksum
from tandem.kvstore.ucx_read import UcxReader

NODE = NodeInfo("n1", "h:1", b"worker-1", 1 << 20, 0)


def _ctx(shm: bool) -> ReaderContext:
    async def connect(node: NodeInfo) -> object:
        raise AssertionError("no connection is made")

    return ReaderContext(1.0, ClientOptions(shm=shm), connect, lambda conn: None)  # type: ignore[arg-type]


def test_the_registry_builds_same_host_then_ucx_readers() -> None:
    readers = make_readers(_ctx(shm=True))
    assert list(readers) == ["shm", "ucx"]
    assert isinstance(readers["shm"], ShmReader) and isinstance(readers["ucx"], UcxReader)
    readers["shm"].close()
    assert list(make_readers(_ctx(shm=False))) == ["ucx"]


def test_a_transport_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'ucx' is already registered"):
        register_reader("ucx", lambda ctx: None)


def test_the_same_host_reader_serves_only_nodes_with_a_segment_here() -> None:
    reader = ShmReader(1.0, 1)
    try:
        assert not reader.serves(NODE)  # no shared segment advertised
        elsewhere = NodeInfo(
            "n2", "h:2", b"w", 1 << 20, 0, host_id="another-host", shm_path="/dev/shm/x", shm_id="1"
        )
        assert not reader.serves(elsewhere)
    finally:
        reader.close()


class Transport:
    """A transport's reader: serves the nodes named, answers as told, records calls."""

    def __init__(self, serves: bool, answer: dict[int, bool | None] | None | Exception) -> None:
        self._serves = serves
        self.answer = answer
        self.calls: list[list[str]] = []

    def serves(self, node: NodeInfo) -> bool:
        return self._serves

    async def fetch(
        self, node: NodeInfo, names: list[str], views: list[np.ndarray], entries: list[IndexEntry]
    ) -> dict[int, bool | None] | None:
        self.calls.append(names)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def retain(self, live: set[str]) -> None:
        pass

    def forget(self, node_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def _get(core: AsyncKVStoreClient) -> int:
    keys = [BlockKey(bytes([i]) * 32, b"f" * 16) for i in range(3)]
    views = [np.full(8, i, dtype=np.uint8) for i in range(3)]
    entries: list[IndexEntry | None] = [
        IndexEntry("n1", i, 8, checksum(v)) for i, v in enumerate(views)
    ]
    return asyncio.run(core.get_indexed(keys, views, entries, {"n1": NODE}))


def test_a_get_reads_through_the_first_reader_that_serves_the_node() -> None:
    core = AsyncKVStoreClient("redis://127.0.0.1:1/0", options=ClientOptions(shm=False))
    other = Transport(serves=False, answer={0: True, 1: True, 2: True})
    declines = Transport(serves=True, answer=None)  # could not read after all
    reads = Transport(serves=True, answer={0: True, 1: None, 2: True})
    core.readers = {"other": other, "declines": declines, "reads": reads}
    assert _get(core) == 3
    names = reads.calls[0]
    assert (other.calls, declines.calls, len(names)) == ([], [names], 3)


def test_a_node_no_reader_serves_or_found_gone_is_a_miss() -> None:
    core = AsyncKVStoreClient("redis://127.0.0.1:1/0", options=ClientOptions(shm=False))
    core.readers = {"none": Transport(serves=False, answer={})}
    assert _get(core) == 0
    gone = Transport(serves=True, answer=KVStoreNodeDownError("connection reset"))
    core.readers = {"gone": gone}
    assert _get(core) == 0
    assert core.down.is_down(NODE)
