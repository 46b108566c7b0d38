"""The UCX reader: blocks of any node moved as UCX tag messages into the caller's buffers.

One ``get`` request per node (kvstore/protocol.py): the node pins the blocks it
holds, answers which are present and sends their payload straight from its
slots; runs of blocks adjacent both in the caller's memory and in the node's
slots move as one message. When the node's slot size is known (its registry
entry), the receives are posted before the request, cut as the index's slots
say, which saves a round trip; a node whose blocks moved since the index was
read answers ``stale``, sends nothing, and the two-step get runs.

Runs on the client loop (kvstore/ucx.py); the caller checks checksums.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from tandem.kvstore import protocol as proto
from tandem.kvstore.index import DISK_SLOT, IndexEntry
from tandem.kvstore.store import (
    KVStoreError,
    KVStoreNodeDownError,
    KVStoreNodeError,
    KVStoreTimeoutError,
)
from tandem.kvstore.transport import NodeConnection, NodeInfo, next_request_id, runs_of, span_of
from tandem.kvstore.ucx import peer_gone, within


class UcxReader:
    """Reads blocks from store nodes over UCX.

    Args:
        connect: the (cached) connection to a node; raises KVStoreError.
        drop: forget a connection that failed (aborting it cancels its posted
            receives, so nothing lands in the caller's buffers afterwards).
        timeout_s: deadline of each node request, seconds.
    """

    def __init__(self, connect: Callable[[NodeInfo], Awaitable[NodeConnection]],
                 drop: Callable[[NodeConnection], None], timeout_s: float) -> None:
        self._connect = connect
        self._drop = drop
        self.timeout_s = timeout_s
        #: gets whose receives were posted before the request (one round trip saved)
        self.num_fast_gets = 0
        #: of those, answered ``stale`` (index older than the node's slots) and redone
        self.num_stale_gets = 0

    def serves(self, node: NodeInfo) -> bool:
        """:meth:`BlockReader.serves <tandem.kvstore.readers.BlockReader.serves>`: every
        registered node listens for UCX."""
        return True

    async def fetch(self, node: NodeInfo, names: list[str], views: list[np.ndarray],
                    entries: list[IndexEntry]) -> dict[int, bool | None] | None:
        """:meth:`BlockReader.fetch <tandem.kvstore.readers.BlockReader.fetch>`: :meth:`read`,
        the checksums left to the caller."""
        return dict.fromkeys(await self.read(node, names, views, entries))

    def retain(self, live: set[str]) -> None:
        """Nothing to let go: the connections are the client's (``Connections``)."""

    def forget(self, node_id: str) -> None:
        """Nothing to let go: the connections are the client's (``Connections``)."""

    def close(self) -> None:
        """Nothing to release: the connections are the client's (``Connections``)."""

    async def read(self, node: NodeInfo, names: list[str], views: list[np.ndarray],
                   entries: list[IndexEntry]) -> set[int]:
        """Fetch blocks ``names`` (index keys) from ``node`` into ``views[i]``.

        ``entries[i]``: the index entry of ``names[i]`` (its slot and size cut the
        receives when the node's slot size is known).

        Returns:
            The indices whose payload arrived (checksums not checked yet).

        Raises:
            KVStoreTimeoutError: the node did not answer within ``timeout_s``.
            KVStoreNodeError: the node refused the request.
            KVStoreNodeDownError: the node refused or reset the connection (it is gone).
            KVStoreError: the connection failed otherwise.
        """
        runs = runs_of(views)
        request: dict[str, object] = {"op": "get", "keys": names, "runs": runs}
        msgs = None
        # a block in the node's disk tier gets a RAM slot only when asked for: no cut
        if node.slot_bytes and all(e.slot != DISK_SLOT for e in entries):
            msgs = proto.group_messages(runs, [e.slot for e in entries],
                                        [e.size_bytes for e in entries], node.slot_bytes)
        for expect in (msgs, None) if msgs is not None else (None,):
            conn = await self._connect(node)
            try:
                present = await within(
                    self._get_once(conn, next_request_id(), node, views, request, expect),
                    self.timeout_s)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                self._drop(conn)
                raise KVStoreTimeoutError(
                    f"get from store node {node.node_id} ({node.address}) timed out after "
                    f"{self.timeout_s}s (node dead or overloaded)") from exc
            except KVStoreError:
                self._drop(conn)  # cancels receives posted for an expected cut
                raise
            except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
                self._drop(conn)
                kind = KVStoreNodeDownError if peer_gone(exc) else KVStoreError
                raise kind(f"get from store node {node.node_id} failed: {exc!r}") from exc
            if present is not None:
                self.num_fast_gets += expect is not None
                return {i for i, hit in enumerate(present) if hit}
            # stale: cancel the receives posted for the expected cut, then retry
            self.num_stale_gets += 1
            self._drop(conn)
        return set()

    async def _get_once(self, conn: NodeConnection, request_id: int, node: NodeInfo,
                        views: list[np.ndarray], request: dict[str, object],
                        expect: list[tuple[int, int]] | None) -> list[bool] | None:
        """One get request; ``None`` when the node answered ``stale``."""
        def post(cut: list[tuple[int, int]]) -> list[asyncio.Future[None]]:
            return [asyncio.ensure_future(conn.ep.recv(
                span_of(views, j, n), tag=proto.make_tag(conn.my_id, request_id, j),
                force_tag=True)) for j, n in cut]

        recvs = post(expect) if expect is not None else []
        msg = dict(request, msgs=expect) if expect is not None else request
        reply = await conn.request(request_id, msg)
        raise_if_error(reply, node)
        if reply.get("stale"):
            return None
        if expect is None:
            recvs = post([(int(j), int(n)) for j, n in reply["msgs"]])
        await asyncio.gather(*recvs)
        return [bool(p) for p in reply["present"]]


def raise_if_error(reply: dict[str, object], node: NodeInfo) -> None:
    """Raise :class:`KVStoreNodeError` with the node's reason if ``reply`` is an error."""
    if reply.get("op") == "error":
        raise KVStoreNodeError(f"store node {node.node_id} ({node.address}): {reply['error']}")
