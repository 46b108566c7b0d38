"""Client of the tandem KV store: what the engine's KV connector calls.

Usage (from any thread except the store's own loop thread; calls block the
caller, never the engine's step loop if made from a transfer thread)::

    from tandem.kvstore.client import KVStoreClient
    from tandem.contracts.block_key import BlockKey

    client = KVStoreClient("redis://127.0.0.1:6379", local_node="10.0.0.5:7000")
    keys = [BlockKey(block_hash, layout.fingerprint) for block_hash in hashes]
    client.put_blocks(keys, [kv_cache[b] for b in block_ids])     # -> blocks stored
    n = client.lookup(keys)                                       # -> leading blocks present
    n = client.get_blocks(keys, into=[kv_cache[b] for b in dst])  # -> leading blocks loaded
    client.close()

Blocks are contiguous CPU buffers (``kv_cache[b]`` of the engine's cache
tensor, numpy arrays, memoryviews); ``get_blocks`` writes straight into
``into`` (no intermediate copy). Misses are counts, never exceptions; errors
are ``ValueError`` (bad input) or :class:`~tandem.kvstore.store.KVStoreError`.

Also ``contains(keys) -> list[bool]`` (per key) and ``put(keys, values)`` and
``get(keys) -> list[ndarray | None]`` (allocates; prefer ``get_blocks``). Consecutive cache blocks
(``kv_cache[b]``, ``kv_cache[b + 1]``...) move as one UCX message: pass blocks in prefix
order and keep the destination block ids ascending where you can.

UCX is not fork-safe: the first client starts a UCX loop thread in this process;
do not fork afterwards (start children with ``spawn`` or subprocess).

Inside an event loop use :class:`AsyncKVStoreClient` (a
:class:`~tandem.kvstore.store.BlockStore`) on the loop of
:func:`tandem.kvstore.ucx.client_loop`; the synchronous facade runs exactly
those coroutines there, so the two never drift apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from redis.exceptions import RedisError

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore.aio_client import AsyncKVStoreClient, leading_count
from tandem.kvstore.shm_read import SameHostReader
from tandem.kvstore.store import KVStoreError, KVStoreNodeError, KVStoreTimeoutError
from tandem.kvstore.transport import NodeInfo
from tandem.kvstore.ucx import client_loop

__all__ = [
    "AsyncKVStoreClient", "KVStoreClient", "KVStoreError", "KVStoreNodeError",
    "KVStoreTimeoutError", "wait_for_nodes",
]

logger = logging.getLogger("tandem.kvstore.client")


class KVStoreClient:
    """Synchronous facade over :class:`AsyncKVStoreClient` for worker threads.

    Every method blocks the calling thread until done (each node request has
    ``timeout_s``); it may be called from several threads at once. Keys are
    :class:`BlockKey` in prefix order; blocks/``into`` are contiguous CPU
    buffers (e.g. ``kv_cache[b]``: ``[num_layers, 2, block_size, num_kv_heads,
    head_dim]`` in the model dtype), one per key.

    Args:
        redis_url: Redis of the store's index and node registry.
        layout: optional :class:`~tandem.contracts.kv_layout.KVCacheLayout`; keys and block sizes are then checked.
        local_node: ``host:port`` or node id of the node to put to first.
        timeout_s: deadline of each node request, seconds.
        shm: read from nodes on this host through shared memory (default: on unless
            ``TANDEM_KV_SHM=0``; see kvstore/shm.py).
        copy_threads: threads that copy and checksum large shared-memory reads
            (default ``TANDEM_KV_COPY_THREADS`` or 2).
    """

    def __init__(self, redis_url: str, *, layout: KVCacheLayout | None = None,
                 local_node: str | None = None, timeout_s: float = 10.0,
                 shm: bool | None = None, copy_threads: int | None = None) -> None:
        self._loop = client_loop()
        self.timeout_s = timeout_s

        async def make() -> AsyncKVStoreClient:
            return AsyncKVStoreClient(redis_url, layout=layout, local_node=local_node,
                                      timeout_s=timeout_s, shm=shm,
                                      copy_threads=copy_threads)

        self.aio = self._loop.run(make(), timeout_s)
        # same-host gets on the calling thread (kvstore/shm_read.py)
        self._same_host = SameHostReader(self.aio, redis_url, timeout_s, self._run) \
            if self.aio.shm else None

    def _run(self, coro: Any) -> Any:
        # NOTE: generous outer bound; the coroutine enforces timeout_s per node request.
        return self._loop.run(coro, 4 * self.timeout_s + 5)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` present on live nodes (metadata only; 0 if the
        index is unreachable). Raises ValueError on a bad key."""
        return self._run(self.aio.lookup(keys))

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: present on a live node. Raises ValueError on a bad key."""
        return self._run(self.aio.contains(keys))

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[Any],
                   ttl_s: float | None = None) -> int:
        """Store ``blocks[i]`` under ``keys[i]`` on one node; returns blocks stored.

        Blocks already on that node are not resent. Returns after the index
        commit; the caller may then reuse ``blocks``.

        Raises:
            ValueError: bad keys/blocks (wrong size, not contiguous, layout mismatch,
                larger than every node).
            KVStoreError: no live node, Redis unreachable, node refused (message
                says why) or :class:`KVStoreTimeoutError`.
        """
        return self._run(self.aio.put(keys, blocks, ttl_s))

    def get_blocks(self, keys: Sequence[BlockKey], into: Sequence[Any]) -> int:
        """Load leading blocks straight into ``into[i]``; returns how many were loaded.

        Stops at the first block that is missing, on a dead node, or fails its
        checksum; ``into[j]`` for ``j >=`` the result hold unspecified bytes.

        Raises:
            ValueError: bad keys/buffers (read-only, not contiguous, wrong size).
            KVStoreTimeoutError: a node holding a leading block stopped answering.
        """
        if self._same_host is not None:
            return self._same_host.get(keys, into)
        return self._run(self.aio.get(keys, into))

    # -- allocating forms (tests, tools) -----------------------------------------------------

    def put(self, keys: Sequence[BlockKey], values: Sequence[Any]) -> int:
        """Alias of :meth:`put_blocks`."""
        return self.put_blocks(keys, values)

    def get(self, keys: Sequence[BlockKey]) -> list[np.ndarray | None]:
        """Each leading block as a new uint8 array, ``None`` from the first miss on.

        NOTE: allocates; :meth:`get_blocks` writes into the cache directly.
        """
        async def run() -> list[np.ndarray | None]:
            self.aio._check_open()
            k = self.aio._check_keys(keys)
            try:
                entries, nodes = await self.aio._index(k)
            except (RedisError, OSError, KVStoreError) as exc:
                logger.warning("get: index unreachable, reporting misses: %s", exc)
                return [None] * len(k)
            n = leading_count(entries)
            sizes = [e.size_bytes for e in entries[:n] if e is not None]
            # one allocation, so that adjacent blocks arrive as one message
            arena = np.empty(sum(sizes), dtype=np.uint8)
            bufs = np.split(arena, np.cumsum(sizes)[:-1]) if n else []
            got = await self.aio._get_indexed(k[:n], bufs, entries[:n], nodes)
            return [bufs[i] if i < got else None for i in range(len(k))]

        return self._run(run())

    def stat(self, node_id: str) -> dict[str, Any]:
        """A node's statistics (``lru`` keys oldest first, ``num_blocks``, ``pinned``...)."""
        return self._run(self.aio.node_request(node_id, {"op": "stat"}))

    def live_nodes(self) -> dict[str, NodeInfo]:
        """Live nodes by id. Raises KVStoreError if Redis is unreachable."""
        return self._run(self.aio.live_nodes())

    def close(self) -> None:
        """Close connections; the process's loop thread stays for other clients."""
        if self._same_host is not None:
            self._same_host.close()
        self._run(self.aio.aclose())

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_nodes(client: KVStoreClient, num_nodes: int, timeout_s: float = 30.0) -> None:
    """Poll the registry until ``num_nodes`` nodes are live (tests, `tandem up`).

    Raises:
        TimeoutError: not reached within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(client.live_nodes()) >= num_nodes:
                return
        except KVStoreError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{num_nodes} KV store nodes not live within {timeout_s}s")
