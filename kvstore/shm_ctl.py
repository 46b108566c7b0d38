"""Same-host control channel: ``get_shm`` and ``release`` over a Unix socket.

Why not UCX: a ``get_shm`` round trip over UCX crosses the client's event loop,
both processes' UCX progress threads, ucxx's notifier threads and the node's
loop, which took longer than copying 16 MiB (docs/benchmarks.md). Here the
node's event loop reads the socket itself and the client's calling thread
writes and reads it: one wake-up each way.

Address: the Linux abstract socket :func:`ctl_address` (no file to leak, gone
with the node), derived from the node id and its segment's identity, so it
needs no registry field. Like the segment, it is reachable only from the
node's host (abstract sockets belong to a network namespace); a client that
cannot connect reads through UCX.

Frames are :func:`tandem.kvstore.protocol.encode`'s (8-byte length + JSON).
Requests: ``get_shm`` (``keys``, ``req``) answered by ``shm`` (``offsets``: byte
offset of each block in the node's segment, -1 when absent; ``sizes``; ``lease``;
``req``) or ``error``: the node pins the present blocks (as a UCX ``get`` does, LRU
touch included) until ``release`` (``lease``; not answered) or the lease's expiry.
When a connection closes, the node releases every
lease it still holds: a client that dies frees its pins at once, not at the
lease's expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.kvstore import protocol as proto

logger = logging.getLogger("tandem.kvstore.shm_ctl")

_LEN = struct.Struct("<Q")


def ctl_address(node_id: str, shm_id: str) -> str:
    """The abstract Unix socket name of a node's control channel."""
    return f"\0tandem-kv/{node_id}/{shm_id}"


class CtlServer:
    """The node side: serves ``get_shm``/``release`` on the node's event loop.

    Args:
        pin: ``async (conn_id, msg) -> reply`` for a ``get_shm`` request (raises
            ValueError for a bad request, answered as ``error``); a coroutine, as the
            node may read blocks back from its disk tier first.
        release: ``(conn_id, lease)``: unpin one lease.
        release_all: ``(conn_id)``: unpin every lease of a closed connection.
    """

    def __init__(self, pin: Callable[[int, dict[str, Any]], Awaitable[dict[str, Any]]],
                 release: Callable[[int, Any], None], release_all: Callable[[int], None]) -> None:
        self._pin, self._release, self._release_all = pin, release, release_all
        self._server: asyncio.AbstractServer | None = None
        self._next_conn = -1  # negative: never a UCX connection id
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, address: str) -> None:
        """Listen on ``address`` (raises OSError when it is taken or unsupported)."""
        self._server = await asyncio.start_unix_server(self._serve, path=address)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = self._next_conn
        self._next_conn -= 1
        self._writers.add(writer)
        try:
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if n > proto.MAX_CTRL_BYTES:
                    logger.warning("control connection %d: frame of %d bytes, closing", conn_id, n)
                    return
                msg = json.loads(await reader.readexactly(n))
                if not isinstance(msg, dict):
                    return
                op = msg.get("op")
                if op == "release":
                    self._release(conn_id, msg.get("lease"))
                    continue
                try:
                    if op != "get_shm":
                        raise ValueError(f"unknown op {op!r} on the shared-memory channel")
                    reply = await self._pin(conn_id, msg)
                except ValueError as exc:
                    reply = {"op": "error", "error": str(exc)}
                reply["req"] = msg.get("req")
                writer.write(proto.encode(reply).tobytes())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass  # closed by the client, or garbage: the connection ends
        finally:
            self._writers.discard(writer)
            self._release_all(conn_id)
            writer.close()


class CtlChannel:
    """The client side: a blocking connection used by one thread at a time.

    Args:
        address: :func:`ctl_address` of the node.
        timeout_s: deadline of every send and receive, seconds.

    Raises:
        OSError: cannot connect (another host or network namespace, node gone).
    """

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(address)
        except BaseException:
            self.sock.close()
            raise
        self._next_req = 1

    def send_get(self, keys: list[str]) -> int:
        """Send ``get_shm`` for ``keys``; returns its request id (raises OSError)."""
        req = self._next_req
        self._next_req += 1
        self.sock.sendall(proto.encode({"op": "get_shm", "req": req, "keys": keys}).tobytes())
        return req

    def recv_reply(self, req: int) -> dict[str, Any]:
        """The node's reply to request ``req``.

        Raises:
            OSError: connection lost or timed out (``TimeoutError``), or a reply to
                another request.
        """
        (n,) = _LEN.unpack(self._recv_exactly(_LEN.size))
        if n > proto.MAX_CTRL_BYTES:
            raise OSError(f"control reply of {n} bytes")
        msg = json.loads(self._recv_exactly(n))
        if not isinstance(msg, dict) or msg.get("req") != req:
            raise OSError(f"control reply out of order (wanted request {req})")
        return msg

    def release(self, lease: int) -> None:
        """Unpin a lease (no reply; raises OSError when the connection is gone, which
        releases the lease anyway)."""
        self.sock.sendall(proto.encode({"op": "release", "lease": lease}).tobytes())

    def _recv_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionResetError("store node closed the shared-memory channel")
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()
