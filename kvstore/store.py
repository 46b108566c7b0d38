"""The batched-first KV block store interface and its errors.

Every call moves a whole batch of blocks (one request's prompt), never one
block at a time: lookups are one Redis round trip, transfers are one request
per store node. A miss is a value (a short count), never an exception: on any
miss the engine recomputes the rest, so output stays right. Exceptions mean
the call itself could not be carried out (bad input, a node that stopped
answering, the index unreachable on a write).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.contracts.block_key import BlockKey


class KVStoreError(RuntimeError):
    """A store operation failed (not a miss)."""


class KVStoreTimeoutError(KVStoreError, TimeoutError):
    """A store node did not answer within the call's timeout (dead or overloaded node)."""


class KVStoreNodeError(KVStoreError):
    """A store node refused a request; the message carries the node's reason."""


class KVStoreNodeDownError(KVStoreError):
    """A store node is gone: it refused or reset the connection, or its process on this
    host has exited. The client treats it as down (its blocks are misses) until a short
    back-off passes or the registry shows it again (:class:`~tandem.kvstore.transport.
    DownNodes`)."""


class BlockStore(abc.ABC):
    """The KV store's one batched interface: what the engine's connector, the benchmarks
    and the tools call (:class:`~tandem.kvstore.client.KVStoreClient` implements it, a thin
    blocking facade over its async core, :class:`~tandem.kvstore.aio_client.
    AsyncKVStoreClient`, whose coroutines keep these semantics on the client loop).

    Every method blocks the calling thread (never an event loop: call it from a worker
    thread) and may be called from several threads at once. Keys are :class:`BlockKey` in
    prefix order (block 0 of a prompt first); "leading" counts stop at the first key that
    misses. Blocks are contiguous CPU buffers (tensor, ndarray, memoryview), one per key.
    """

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` the store can serve now.

        Reads only the metadata index (no payload moves). A key whose index entry
        is gone, expired, or points at a node without a live heartbeat is a miss.
        Index unreachable: 0 (a miss), never raises for that.

        Raises:
            ValueError: a key that is not a :class:`BlockKey`.
        """

    @abc.abstractmethod
    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[Any],
                   ttl_s: float | None = None, *,
                   trace_headers: Mapping[str, str] | None = None) -> int:
        """Store ``blocks[i]`` under ``keys[i]``; returns how many blocks are stored after
        the call (already present keys count and are not sent again).

        Payload moves first, then the index entries of the batch are committed
        in one atomic Redis update, so a reader never sees an entry whose bytes
        are not all there. The caller may reuse ``blocks`` once this returns.
        ``trace_headers``: a W3C trace context (``traceparent``) the store node's span
        of this put joins.

        Raises:
            ValueError: lengths differ, a block is not contiguous, its size is not
                the layout's block size, or the batch is larger than a node.
            KVStoreError: no live node, index unreachable, node refused or timed out.
        """

    @abc.abstractmethod
    def get_blocks(self, keys: Sequence[BlockKey], into: Sequence[Any]) -> int:
        """Load the leading present blocks into ``into[i]`` (writable contiguous buffers
        of each block's size); returns how many leading blocks were loaded.

        Each block's checksum is verified after it arrived: a mismatch is a miss
        (the count stops there), as is a block on a node found dead. ``into[j]``
        beyond the returned count hold unspecified bytes.

        Raises:
            ValueError: lengths differ or a buffer is not writable/contiguous or has
                the wrong size.
            KVStoreTimeoutError: a node holding one of the leading blocks did not
                answer within the timeout.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; further calls raise :class:`KVStoreError`."""
