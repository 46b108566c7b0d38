"""Client side of store-node connections: ids, message spans, node records, connections.

Used by the client (kvstore/aio_client.py) and its readers; see :mod:`tandem.kvstore.protocol` for
the wire format.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from tandem.kvstore import protocol as proto
from tandem.kvstore.index import IndexEntry, parse_lookup
from tandem.kvstore.store import KVStoreNodeDownError, KVStoreTimeoutError
from tandem.kvstore.ucx import Endpoint, endpoint_to, peer_gone, worker_address

logger = logging.getLogger("tandem.kvstore.client")

# NOTE: every client of the process shares one UCX worker, so connection and
# request ids (parts of the receive tags) are process-wide.
_conn_ids = itertools.count(1)
_request_ids = itertools.count(1)


def next_conn_id() -> int:
    return next(_conn_ids) % 0xFFFE + 1


def next_request_id() -> int:
    return next(_request_ids) % (proto.CTRL_PART - 1) + 1


def address_of(view: np.ndarray) -> int:
    """Address of a view's first byte."""
    try:
        # NOTE: a third of the time __array_interface__ takes (once per block per call)
        return ctypes.addressof(ctypes.c_char.from_buffer(view))  # type: ignore[arg-type]
    except TypeError:  # read-only (a put's source): from_buffer needs a writable one
        return int(view.__array_interface__["data"][0])


def span_of(views: list[np.ndarray], first: int, count: int) -> np.ndarray:
    """One uint8 array over ``views[first:first + count]``, which are adjacent in memory.

    NOTE: built from the address; valid while the caller's buffers live, i.e.
    for the duration of the transfer that uses it.
    """
    if count == 1:
        return views[first]
    nbytes = sum(v.nbytes for v in views[first : first + count])
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(address_of(views[first])))


def runs_of(views: list[np.ndarray]) -> list[list[int]]:
    return proto.adjacent_runs([address_of(v) for v in views], [v.nbytes for v in views])


def checksum(view: np.ndarray) -> str:
    """xxh3-64 of a block's bytes, hex (the index's checksum)."""
    return xxhash.xxh3_64_hexdigest(view.data)


@dataclass
class NodeInfo:
    """A live node as its registry entry describes it."""

    node_id: str
    address: str
    ucx_address: bytes
    capacity_bytes: int
    used_bytes: int
    slot_bytes: int = 0
    #: kvstore/shm.py: the node's host identity and shared segment ("" without one)
    host_id: str = ""
    shm_path: str = ""
    shm_id: str = ""

    @classmethod
    def from_hash(cls, node_id: str, h: dict[bytes, bytes]) -> NodeInfo | None:
        try:
            return cls(node_id, h[b"address"].decode(), bytes.fromhex(h[b"ucx_address"].decode()),
                       int(h[b"capacity_bytes"]), int(h[b"used_bytes"]),
                       int(h.get(b"slot_bytes", b"0")), h.get(b"host_id", b"").decode(),
                       h.get(b"shm_path", b"").decode(), h.get(b"shm_id", b"").decode())
        except (KeyError, ValueError):
            return None

    @classmethod
    def from_lookup(cls, fields: list[str]) -> NodeInfo:
        """From one node record of :func:`tandem.kvstore.index.parse_lookup`.

        Raises:
            ValueError: malformed fields.
        """
        nid, address, ucx, cap, used, slot, host, shm_path, shm_id = fields
        return cls(nid, address, bytes.fromhex(ucx), int(cap), int(used), int(slot), host,
                   shm_path, shm_id)


def parse_index_reply(num_keys: int, reply: list[bytes | str]
                      ) -> tuple[list[IndexEntry | None], dict[str, NodeInfo]]:
    """A :data:`~tandem.kvstore.index.LOOKUP_LUA` reply: the entry of each key
    (``None``: absent) and the live nodes they name, by id.

    Raises:
        ValueError: malformed reply.
    """
    entries, records = parse_lookup(num_keys, reply)
    return entries, {r[0]: NodeInfo.from_lookup(r) for r in records}


class DownNodes:
    """The nodes a client found gone (:class:`~tandem.kvstore.store.KVStoreNodeDownError`),
    each until ``retry_s`` passes or the registry shows it again with another UCX worker
    address (it restarted); meanwhile its blocks are misses and puts avoid it.

    Why: until a dead node's heartbeat expires the registry still lists it, and each
    read of it would otherwise wait for the node again.

    Args:
        retry_s: seconds before a down node is tried again.
        clock: monotonic seconds (tests pass their own).

    Thread-safe (the blocking facade asks from the caller's thread).
    """

    def __init__(self, retry_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if retry_s <= 0:
            raise ValueError(f"retry_s must be > 0, got {retry_s}")
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, tuple[bytes, float]] = {}  # id -> (worker address, until)
        #: times a node was marked down
        self.num_marked = 0

    def mark(self, node: NodeInfo, reason: object) -> None:
        """``node`` is gone (``reason``: why, for the log)."""
        with self._lock:
            known = node.node_id in self._down
            self._down[node.node_id] = (node.ucx_address, self._clock() + self.retry_s)
            self.num_marked += 1
        if not known:
            logger.warning("store node %s (%s) is down, its blocks are misses for %.1fs: %s",
                           node.node_id, node.address, self.retry_s, reason)

    def is_down(self, node: NodeInfo) -> bool:
        """Whether ``node``, as the registry describes it now, is still down."""
        with self._lock:
            entry = self._down.get(node.node_id)
            if entry is None:
                return False
            address, until = entry
            if address != node.ucx_address or self._clock() >= until:
                del self._down[node.node_id]
                return False
            return True


class NodeConnection:
    """One connection to a node: our endpoint and the receive ids of each side."""

    def __init__(self, node_id: str, ucx_address: bytes, ep: Endpoint, my_id: int,
                 peer_id: int) -> None:
        self.node_id = node_id
        self.ucx_address = ucx_address
        self.ep = ep
        self.my_id = my_id
        self.peer_id = peer_id
        self.closed = False
        self.watcher: asyncio.Future[None] | None = None

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.ep.abort()

    async def request(self, request_id: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Post the reply's receive, send ``msg`` and return the node's reply.

        The send's completion and the reply are awaited together: awaiting the send
        first would put one more completion hand-off from UCX's threads to the loop
        on the request's critical path. On an error the reply's
        receive may stay posted: the caller drops the connection, which cancels it.

        Raises:
            ValueError: ``msg`` too large (see :func:`protocol.encode`).
            Exception: whatever UCX raises (the connection is unusable).
        """
        payload = proto.encode(dict(msg, req=request_id))
        reply = asyncio.ensure_future(self._recv_ctrl(proto.ctrl_buffer(), request_id))
        send = self.ep.send(payload, tag=proto.make_tag(self.peer_id, 0xFFFFFF, proto.CTRL_PART),
                            force_tag=True)
        _, answer = await asyncio.gather(send, reply)
        return answer

    async def _recv_ctrl(self, buf: np.ndarray, request_id: int) -> dict[str, Any]:
        await self.ep.recv(buf, tag=proto.make_tag(self.my_id, request_id, proto.CTRL_PART),
                           force_tag=True)
        return proto.decode(buf)

    async def next_reply(self, request_id: int) -> dict[str, Any]:
        return await self._recv_ctrl(proto.ctrl_buffer(), request_id)


class Connections:
    """The client's UCX connections to store nodes: one per node, made on first use
    (HELLO / welcome, kvstore/protocol.py), replaced when the node restarts.

    Args:
        timeout_s: deadline of the handshake, seconds.
        on_drop: called with the node id whenever a connection is dropped.

    Runs on the client loop (not thread-safe).
    """

    def __init__(self, timeout_s: float, on_drop: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self._on_drop = on_drop
        self._conns: dict[str, NodeConnection] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, node: NodeInfo) -> NodeConnection:
        """The connection to ``node``, made if there is none or the node restarted.

        Raises:
            KVStoreTimeoutError: no welcome within ``timeout_s``.
            KVStoreNodeDownError: the node refused the connection or reset it.
        """
        lock = self._locks.setdefault(node.node_id, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node.node_id)
            if conn is not None and not conn.closed and conn.ucx_address == node.ucx_address:
                return conn
            if conn is not None:
                conn.abort()  # the node restarted (new address) or the connection failed
            try:
                ep = await endpoint_to(node.ucx_address)
            except Exception as exc:
                if peer_gone(exc):
                    raise KVStoreNodeDownError(
                        f"store node {node.node_id} ({node.address}): connection "
                        f"failed: {exc!r}") from exc
                raise
            my_id = next_conn_id()
            buf = proto.ctrl_buffer()
            welcome = asyncio.ensure_future(
                ep.recv(buf, tag=proto.make_tag(my_id, 0, proto.CTRL_PART), force_tag=True))
            hello = {"op": "hello", "address": worker_address().hex(), "conn_id": my_id}
            try:
                await asyncio.wait_for(
                    asyncio.gather(ep.send(proto.encode(hello), tag=proto.HELLO_TAG,
                                           force_tag=True), welcome),
                    self.timeout_s)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                ep.abort()
                raise KVStoreTimeoutError(
                    f"store node {node.node_id} ({node.address}) did not answer the "
                    f"connection handshake within {self.timeout_s}s") from exc
            except Exception as exc:
                ep.abort()
                if peer_gone(exc):
                    raise KVStoreNodeDownError(
                        f"store node {node.node_id} ({node.address}): connection "
                        f"handshake failed: {exc!r}") from exc
                raise
            msg = proto.decode(buf)
            conn = NodeConnection(node.node_id, node.ucx_address, ep, my_id, int(msg["conn_id"]))
            self._conns[node.node_id] = conn
            conn.watcher = asyncio.ensure_future(self._watch(conn))
            return conn

    async def _watch(self, conn: NodeConnection) -> None:
        """Wait for the node's ``bye`` (request id 0) and drop the connection then: its
        pending requests fail at once instead of at their timeout."""
        try:
            msg = await conn.next_reply(0)
        except Exception:  # noqa: BLE001 - endpoint aborted: the connection is gone anyway
            return
        logger.info("store node %s closed our connection: %s", conn.node_id, msg.get("reason"))
        self.drop(conn)

    def drop(self, conn: NodeConnection) -> None:
        """Abort a connection that failed (aborting cancels its posted receives) and
        forget it."""
        conn.abort()
        if self._conns.get(conn.node_id) is conn:
            del self._conns[conn.node_id]
        self._on_drop(conn.node_id)

    def drop_node(self, node_id: str) -> None:
        """:meth:`drop` the connection to ``node_id``, if any (its node is dead)."""
        conn = self._conns.get(node_id)
        if conn is not None:
            self.drop(conn)

    def close(self) -> None:
        """Drop every connection."""
        for conn in list(self._conns.values()):
            self.drop(conn)
