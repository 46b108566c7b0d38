"""Client side of one store-node connection: ids, message spans, node records.

Used by :mod:`tandem.kvstore.aio_client`; see :mod:`tandem.kvstore.protocol` for
the wire format.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from tandem.kvstore import protocol as proto

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
        # NOTE: ~0.3 us where __array_interface__ takes ~1 us (once per block per call)
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
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


class NodeConnection:
    """One connection to a node: our endpoint and the receive ids of each side."""

    def __init__(self, node_id: str, ucx_address: bytes, ep: Any, my_id: int, peer_id: int):
        self.node_id = node_id
        self.ucx_address = ucx_address
        self.ep = ep
        self.my_id = my_id
        self.peer_id = peer_id
        self.closed = False
        self.watcher: asyncio.Future[Any] | None = None

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.ep.abort()

    async def request(self, request_id: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Post the reply's receive, send ``msg`` and return the node's reply.

        The send's completion and the reply are awaited together: awaiting the send
        first would put one more completion hand-off from UCX's threads to the loop
        (~0.1-0.3 ms) on the request's critical path. On an error the reply's
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
