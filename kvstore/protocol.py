"""Wire protocol between store clients and store nodes over UCX tag messages.

Connections: a node publishes its UCX worker address in its registry entry
(kvstore/index.py). A client creates an endpoint from it and sends ``HELLO``
(its own worker address and the connection id it chose) to the node's worker
with :data:`HELLO_TAG`; the node creates the reverse endpoint and answers with
the connection id it chose. Endpoints from worker addresses let UCX pick
shared memory (posix/cma) between processes of one host and TCP/RDMA across
hosts; a listener connection would force peer error handling, which rules out
the shared-memory transports.

Tags (64 bit) are chosen by the receiver so that they never collide on its worker:
``conn_id (16) | request_id (24) | part (24)``. Part :data:`CTRL_PART` carries a
control message (a length-prefixed JSON object in a :data:`MAX_CTRL_BYTES`
buffer); parts ``0..n-1`` carry block ``i``'s payload, straight from/to slot
memory and the caller's buffers.

Requests (client -> node control, ``request_id`` chosen by the client):
- ``put``: ``keys``, ``sizes``, ``checksums``, ``ttl_s``, ``runs`` -> reply
  ``accept`` with ``msgs`` (:func:`group_messages`; blocks already stored are
  not in any) or ``error``; the client sends the messages; the node commits and
  replies ``stored``.
- ``get``: ``keys``, ``runs`` -> reply ``present`` (bool per key), ``sizes`` and
  ``msgs``; the node then sends the messages.

NOTE: a message may span several blocks: runs of blocks adjacent both in the
client's memory (consecutive ``kv_cache`` block ids) and in the pool move as
one UCX message, because the per-message cost in Python, not bandwidth, bounds
small blocks.
- ``stat``: -> node statistics.

Same-host reads (``get_shm`` / ``release``) use these messages' encoding on the
node's Unix control socket instead (kvstore/shm_ctl.py), never UCX.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

#: Tag on which a node's worker receives HELLO messages.
HELLO_TAG = 0xFFFF_FFFF_FFFF_FFFE
#: Part number of control messages.
CTRL_PART = 0xFFFFFF
#: Largest control message (bytes, incl. the 8-byte length prefix).
MAX_CTRL_BYTES = 1 << 20
#: Largest number of blocks in one request (part numbers are 24 bit).
MAX_BLOCKS_PER_REQUEST = CTRL_PART - 1
_LEN = struct.Struct("<Q")


def group_messages(runs: list[list[int]], slots: list[int | None], sizes: list[int],
                   slot_bytes: int) -> list[tuple[int, int]]:
    """Cut a batch into messages: ``(first index, count)`` per message.

    A message covers consecutive blocks that are adjacent on both ends: inside
    one of the client's ``runs`` (``[start, count]`` of blocks adjacent in its
    memory) and in consecutive slots, each but the last filling its slot. Blocks
    with ``slots[i] is None`` are not sent. Both sides derive the same cut.

    Raises:
        ValueError: a run outside the batch.
    """
    n = len(slots)
    msgs: list[tuple[int, int]] = []
    for run in runs:
        if len(run) != 2 or run[0] < 0 or run[1] < 1 or run[0] + run[1] > n:
            raise ValueError(f"run {run!r} outside the batch of {n} blocks")
        start, count = run
        i = start
        while i < start + count:
            slot = slots[i]
            if slot is None:
                i += 1
                continue
            j = i
            while (j + 1 < start + count and slots[j + 1] is not None
                   and slots[j + 1] == slots[j] + 1 and sizes[j] == slot_bytes):  # type: ignore[operator]
                j += 1
            msgs.append((i, j - i + 1))
            i = j + 1
    return msgs


def adjacent_runs(addresses: list[int], sizes: list[int]) -> list[list[int]]:
    """``[start, count]`` runs of buffers that follow each other in memory."""
    runs: list[list[int]] = []
    for i, (a, n) in enumerate(zip(addresses, sizes, strict=True)):
        if runs and addresses[i - 1] + sizes[i - 1] == a:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
        del n
    return runs


def make_tag(conn_id: int, request_id: int, part: int) -> int:
    """Receiver-side tag of one message (see the module docstring)."""
    return ((conn_id & 0xFFFF) << 48) | ((request_id & 0xFFFFFF) << 24) | (part & 0xFFFFFF)


def encode(msg: dict[str, Any]) -> np.ndarray:
    """Control message -> uint8 array ``len | json``.

    Raises:
        ValueError: message larger than :data:`MAX_CTRL_BYTES`.
    """
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) + _LEN.size > MAX_CTRL_BYTES:
        raise ValueError(
            f"control message of {len(body)} bytes exceeds {MAX_CTRL_BYTES}; use smaller batches"
        )
    return np.frombuffer(_LEN.pack(len(body)) + body, dtype=np.uint8)


def ctrl_buffer() -> np.ndarray:
    """A receive buffer for one control message."""
    return np.empty(MAX_CTRL_BYTES, dtype=np.uint8)


def decode(buf: np.ndarray) -> dict[str, Any]:
    """Inverse of :func:`encode` on a received buffer.

    Raises:
        ValueError: malformed message.
    """
    (n,) = _LEN.unpack_from(buf.data, 0)
    if n > MAX_CTRL_BYTES - _LEN.size:
        raise ValueError(f"control message length {n} out of range")
    msg = json.loads(bytes(buf[_LEN.size : _LEN.size + n]))
    if not isinstance(msg, dict):
        raise ValueError("control message must be a JSON object")
    return msg
