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
Consecutive cache blocks (``kv_cache[b]``, ``kv_cache[b + 1]``...) move as one
message or copy: pass blocks in prefix order and keep the destination block ids
ascending where you can.

UCX is not fork-safe: the first client starts a UCX loop thread in this process;
do not fork afterwards (start children with ``spawn`` or subprocess).

:class:`KVStoreClient` is a blocking facade over
:class:`~tandem.kvstore.aio_client.AsyncKVStoreClient` (use that one inside an
event loop, on :func:`tandem.kvstore.ucx.client_loop`'s loop) and calls only its
public methods, so the two never drift apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import TypeVar

import redis
from redis.exceptions import RedisError

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore.aio_client import AsyncKVStoreClient, Indexed
from tandem.kvstore.config import ClientOptions
from tandem.kvstore.index import LOOKUP_LUA, NODE_PREFIX
from tandem.kvstore.index_entries import checksum_verdicts, leading_by_node
from tandem.kvstore.store import BlockStore, KVStoreError, KVStoreNodeError, KVStoreTimeoutError
from tandem.kvstore.transport import NodeInfo, parse_index_reply
from tandem.kvstore.ucx import client_loop

__all__ = [
    "AsyncKVStoreClient", "ClientOptions", "KVStoreClient", "KVStoreError",
    "KVStoreNodeError", "KVStoreTimeoutError", "wait_for_nodes",
]

logger = logging.getLogger("tandem.kvstore.client")

T = TypeVar("T")


class KVStoreClient(BlockStore):
    """The :class:`~tandem.kvstore.store.BlockStore`: a blocking facade over
    :class:`AsyncKVStoreClient` for worker threads.

    Every method blocks the calling thread until done (each node request has
    ``timeout_s``); it may be called from several threads at once. Keys are
    :class:`BlockKey` in prefix order; blocks/``into`` are contiguous CPU
    buffers (e.g. ``kv_cache[b]``: ``[num_layers, 2, block_size, num_kv_heads,
    head_dim]`` in the model dtype), one per key.

    A get whose leading blocks all sit on one node of this host runs entirely on
    the calling thread: the index lookup on a blocking Redis connection, then the
    same-host reader (kvstore/shm_read.py); any other get runs on the client loop.

    Args:
        redis_url: Redis of the store's index and node registry.
        layout: optional :class:`~tandem.contracts.kv_layout.KVCacheLayout`; keys and block sizes are then checked.
        local_node: ``host:port`` or node id of the node to put to first.
        timeout_s: deadline of each node request, seconds.
        options: shared-memory reads, copy threads, UCX (kvstore/config.py); the
            entry points build them with :meth:`ClientOptions.from_environ`.
    """

    def __init__(self, redis_url: str, *, layout: KVCacheLayout | None = None,
                 local_node: str | None = None, timeout_s: float = 10.0,
                 options: ClientOptions = ClientOptions()) -> None:
        self._loop = client_loop(options.ucx)
        self.timeout_s = timeout_s

        async def make() -> AsyncKVStoreClient:
            return AsyncKVStoreClient(redis_url, layout=layout, local_node=local_node,
                                      timeout_s=timeout_s, options=options)

        #: the async core every call goes through
        self.aio = self._loop.run(make(), timeout_s)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s) \
            if self.aio.shm is not None else None
        self._lookup = self._redis.register_script(LOOKUP_LUA) if self._redis else None

    def run(self, coro: Coroutine[object, object, T]) -> T:
        """Run a coroutine of :attr:`aio` on the client loop; returns its result.

        Raises:
            whatever the coroutine raises; TimeoutError past a generous outer bound
            (the coroutine enforces ``timeout_s`` per node request).
        """
        return self._loop.run(coro, 4 * self.timeout_s + 5)

    @property
    def num_shm_reads(self) -> int:
        """Node reads served from a shared-memory segment so far."""
        return self.aio.shm.num_reads if self.aio.shm is not None else 0

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Number of leading ``keys`` present on live nodes (metadata only; 0 if the
        index is unreachable). Raises ValueError on a bad key."""
        return self.run(self.aio.lookup(keys))

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Per key: present on a live node. Raises ValueError on a bad key."""
        return self.run(self.aio.contains(keys))

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[object],
                   ttl_s: float | None = None, *,
                   trace_headers: Mapping[str, str] | None = None) -> int:
        """Store ``blocks[i]`` under ``keys[i]`` on one node; returns blocks stored.

        Blocks already on that node are not resent. Returns after the index
        commit; the caller may then reuse ``blocks``. ``trace_headers``: a W3C trace
        context (``traceparent``) the node's span of this put joins.

        Raises:
            ValueError: bad keys/blocks (wrong size, not contiguous, layout mismatch,
                larger than every node).
            KVStoreError: no live node, Redis unreachable, node refused (message
                says why) or :class:`KVStoreTimeoutError`.
        """
        return self.run(self.aio.put(keys, blocks, ttl_s, trace_headers=trace_headers))

    def get_blocks(self, keys: Sequence[BlockKey], into: Sequence[object]) -> int:
        """Load leading blocks straight into ``into[i]``; returns how many were loaded.

        Stops at the first block that is missing, on a dead node (one whose heartbeat
        expired, or that this client found gone: see
        :class:`~tandem.kvstore.aio_client.AsyncKVStoreClient`), or fails its checksum;
        ``into[j]`` for ``j >=`` the result hold unspecified bytes.

        Raises:
            ValueError: bad keys/buffers (read-only, not contiguous, wrong size,
                overlapping).
            KVStoreTimeoutError: a node holding a leading block stopped answering.
        """
        aio = self.aio
        if aio.shm is None:
            return self.run(aio.get(keys, into))
        aio.check_open()
        checked = aio.check_keys(keys)
        views = aio.byte_views(into, len(checked), writable=True, name="into")
        if not checked:
            return 0
        try:
            entries, nodes = self._index(checked)
        except (RedisError, OSError) as exc:
            logger.warning("get: index unreachable, reporting a miss: %s", exc)
            return 0
        if any(e is not None and e.node_id not in nodes for e in entries) \
                or any(aio.down.is_down(node) for node in nodes.values()):
            # a dead node's entries: the core turns them into misses (and removes those
            # of expired nodes)
            return self.run(aio.get_indexed(checked, views, entries, nodes))
        n, by_node = leading_by_node(entries, views)
        if n == 0:
            return 0
        node = nodes[next(iter(by_node))] if len(by_node) == 1 else None
        sums = None
        if node is not None:
            sums = aio.shm.read(node, [k.redis_key for k in checked[:n]], views[:n])
        if sums is None:  # several nodes, or one not readable from this host
            return self.run(aio.get_indexed(checked, views, entries, nodes))
        count, stale = aio.tally(checked, views, entries, n, checksum_verdicts(sums, entries))
        if stale:
            self.run(aio.forget(stale))
        return count

    def _index(self, keys: list[BlockKey]) -> Indexed:
        """The index lookup on this thread (no hop to the client loop).

        Raises:
            RedisError / OSError: Redis unreachable; KVStoreError: malformed reply.
        """
        assert self._lookup is not None, "a blocking index only with the same-host reader"
        reply = self._lookup(keys=[k.redis_key for k in keys], args=[NODE_PREFIX])
        try:
            return parse_index_reply(len(keys), reply)
        except ValueError as exc:
            raise KVStoreError(f"KV store index (Redis) answered a malformed lookup: {exc}") \
                from exc

    def stat(self, node_id: str) -> dict[str, object]:
        """A node's statistics (``lru`` keys oldest first, ``num_blocks``, ``pinned``...)."""
        return self.run(self.aio.stat(node_id))

    def live_nodes(self) -> dict[str, NodeInfo]:
        """Live nodes by id. Raises KVStoreError if Redis is unreachable."""
        return self.run(self.aio.live_nodes())

    def close(self) -> None:
        """Close connections; the process's loop thread stays for other clients."""
        self.run(self.aio.aclose())
        if self._redis is not None:
            self._redis.close()

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
