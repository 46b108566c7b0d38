"""The store client's async core (:class:`AsyncKVStoreClient`): the coroutines behind the
``BlockStore`` facade (kvstore/client.py), with its semantics.

It owns the index (Redis), the node registry and the UCX connections, puts
blocks, and reads them with one reader per transport, chosen per node by the registry of
kvstore/readers.py: :class:`ShmReader` (kvstore/shm_read.py) for nodes on this host,
:class:`UcxReader` (kvstore/ucx_read.py) for the others. Run its coroutines on
:func:`tandem.kvstore.ucx.client_loop`; :mod:`tandem.kvstore.client` is the
blocking facade threads use. Keys, buffers and semantics: kvstore/store.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence, Set

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore import protocol as proto
from tandem.kvstore.buffers import byte_views, check_keys
from tandem.kvstore.config import ClientOptions
from tandem.kvstore.index import (
    COMMIT_LUA,
    LOOKUP_LUA,
    NODE_PREFIX,
    NODES_SET,
    IndexEntry,
    node_key,
)
from tandem.kvstore.index_entries import (
    leading_by_node,
    leading_count,
    without_down,
)
from tandem.kvstore.readers import ReaderContext, make_readers
from tandem.kvstore.shm import host_id, segment_gone
from tandem.kvstore.shm_read import ShmReader
from tandem.kvstore.store import (
    KVStoreError,
    KVStoreNodeDownError,
    KVStoreTimeoutError,
)
from tandem.kvstore.transport import (
    Connections,
    DownNodes,
    NodeInfo,
    checksum,
    next_request_id,
    parse_index_reply,
    runs_of,
    span_of,
)
from tandem.kvstore.ucx import peer_gone, within
from tandem.kvstore.ucx_read import UcxReader, raise_if_error

logger = logging.getLogger("tandem.kvstore.client")

#: index entries of ``keys`` (``None``: absent) and the live nodes they name
Indexed = tuple[list[IndexEntry | None], dict[str, NodeInfo]]


class AsyncKVStoreClient:
    """The store client's coroutines; run them on :func:`~tandem.kvstore.ucx.client_loop`.

    Args:
        redis_url: Redis of the block index and node registry.
        layout: if given, every key must carry this layout's fingerprint and every
            block must be ``layout.block_bytes`` long (ValueError otherwise).
        local_node: ``host:port`` (or node id) of the node on this host: puts go
            there while it is alive, else to the least full live node.
        timeout_s: deadline of each node request (connect, put, get), seconds.
        options: shared-memory reads and their copy threads, the down-node back-off
            (kvstore/config.py).

    A node that is gone (it refused or reset the connection, or, on this host, its
    process exited) is marked down at once (:attr:`down`): its blocks are misses and
    puts go elsewhere until ``options.down_node_retry_s`` passes or the registry shows
    it restarted, instead of each call waiting ``timeout_s`` for it until its heartbeat
    expires. A node that stops answering (hung) still costs ``timeout_s``.

    Raises:
        ValueError: ``timeout_s`` <= 0.
    """

    def __init__(self, redis_url: str, *, layout: KVCacheLayout | None = None,
                 local_node: str | None = None, timeout_s: float = 10.0,
                 options: ClientOptions = ClientOptions()) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.layout = layout
        self.local_node = local_node
        self.timeout_s = timeout_s
        self.options = options
        self.redis = aioredis.from_url(redis_url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s)
        self._commit = self.redis.register_script(COMMIT_LUA)
        self._lookup = self.redis.register_script(LOOKUP_LUA)
        self._nodes_cache: tuple[float, dict[str, NodeInfo]] | None = None
        self._closed = False
        #: the UCX connections to nodes
        self.conns = Connections(timeout_s, self._dropped)
        #: one reader per transport the options allow, by name, in the order tried
        #: (kvstore/readers.py)
        self.readers = make_readers(ReaderContext(timeout_s, options, self.conns.get,
                                                  self.conns.drop))
        #: blocks whose bytes failed their checksum (each a miss, its entry removed)
        self.num_checksum_failures = 0
        #: nodes found gone, left alone for a while
        self.down = DownNodes(options.down_node_retry_s)
        self._host_id = host_id()

    @property
    def shm(self) -> ShmReader | None:
        """The same-host reader (``None``: shared-memory reads off); the blocking facade
        reads through it on the calling thread (kvstore/client.py)."""
        reader = self.readers.get("shm")
        return reader if isinstance(reader, ShmReader) else None

    @property
    def ucx(self) -> UcxReader:
        """The UCX reader (its counters: fast and stale gets)."""
        reader = self.readers["ucx"]
        assert isinstance(reader, UcxReader), "the ucx reader is registered"
        return reader

    # -- validation ---------------------------------------------------------------------------

    def check_open(self) -> None:
        """Raises KVStoreError once the client is closed."""
        if self._closed:
            raise KVStoreError("client is closed")

    def check_keys(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """:func:`~tandem.kvstore.buffers.check_keys` against this client's layout."""
        return check_keys(keys, self.layout)

    def byte_views(self, blocks: Sequence[object], n: int, *, writable: bool,
                   name: str) -> list[np.ndarray]:
        """:func:`~tandem.kvstore.buffers.byte_views` against this client's layout."""
        return byte_views(blocks, n, writable=writable, name=name, layout=self.layout)

    # -- registry ---------------------------------------------------------------

    async def live_nodes(self) -> dict[str, NodeInfo]:
        """Nodes whose heartbeat has not expired, by node id.

        Raises:
            KVStoreError: Redis unreachable.
        """
        try:
            ids = [i.decode() if isinstance(i, bytes) else str(i)
                   for i in await self.redis.smembers(NODES_SET)]
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in ids:
                    pipe.hgetall(node_key(i))
                hashes = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise KVStoreError(f"KV store index (Redis) unreachable: {exc}") from exc
        nodes = {}
        for i, h in zip(ids, hashes, strict=True):
            info = NodeInfo.from_hash(i, h) if h else None
            if info is not None:
                nodes[i] = info
        for reader in self.readers.values():
            reader.retain(set(nodes))  # a dead node's segment lives while we map it
        return nodes

    async def _live_nodes_cached(self) -> dict[str, NodeInfo]:
        """:meth:`live_nodes`, reused for up to a second (the put policy needs only a
        recent view; a node that died since then costs one put timeout)."""
        now = time.monotonic()
        if self._nodes_cache is None or now - self._nodes_cache[0] > 1.0:
            self._nodes_cache = (now, await self.live_nodes())
        return self._nodes_cache[1]

    def node_gone(self, node: NodeInfo) -> bool:
        """Whether ``node`` is down (:attr:`down`), or found gone now: a node of this
        host whose process exited (its segment's ``/proc`` path, one ``stat``), which
        is then marked down. Nodes elsewhere are found gone by their connections."""
        if self.down.is_down(node):
            return True
        if node.shm_path and node.shm_id and node.host_id == self._host_id \
                and segment_gone(node.shm_path, node.shm_id):
            self.mark_down(node, f"its process on this host exited ({node.shm_path} is gone)")
            return True
        return False

    def mark_down(self, node: NodeInfo, reason: object) -> None:
        """Mark ``node`` down (:attr:`down`) and drop its connection, which cancels
        what is posted on it and unmaps its segment."""
        self.down.mark(node, reason)
        self.conns.drop_node(node.node_id)
        for reader in self.readers.values():
            reader.forget(node.node_id)

    def _dropped(self, node_id: str) -> None:
        """A connection to ``node_id`` failed or its node is gone (see Connections)."""
        self._nodes_cache = None
        for reader in self.readers.values():
            reader.forget(node_id)  # NOTE: map a restarted node's segment afresh

    def _choose_node(self, nodes: dict[str, NodeInfo], nbytes: int) -> NodeInfo:
        nodes = {i: n for i, n in nodes.items() if not self.node_gone(n)}
        if not nodes:
            raise KVStoreError("no live KV store node (none registered with a fresh heartbeat)")
        if self.local_node:
            for n in nodes.values():
                if self.local_node in (n.node_id, n.address) and n.capacity_bytes >= nbytes:
                    return n
        fits = [n for n in nodes.values() if n.capacity_bytes >= nbytes]
        if not fits:
            raise ValueError(
                f"blocks: put of {nbytes} bytes is larger than every node's capacity "
                f"(largest {max(n.capacity_bytes for n in nodes.values())} bytes)"
            )
        return min(fits, key=lambda n: (n.used_bytes / n.capacity_bytes, n.node_id))

    # -- index --------------------------------------------------------------------------------

    async def index(self, keys: list[BlockKey]) -> Indexed:
        """Index entries of (checked) ``keys`` and the live nodes they name; entries of
        dead nodes are misses, and removed from the index.

        Raises:
            RedisError / OSError: Redis unreachable; KVStoreError: malformed reply.
        """
        if not keys:
            return [], {}
        reply = await self._lookup(keys=[k.redis_key for k in keys], args=[NODE_PREFIX])
        try:
            entries, nodes = parse_index_reply(len(keys), reply)
        except ValueError as exc:
            raise KVStoreError(f"KV store index (Redis) answered a malformed lookup: {exc}") \
                from exc
        return without_down(await self._without_dead(keys, entries, nodes), nodes, self.down), \
            nodes

    async def _without_dead(self, keys: list[BlockKey], entries: list[IndexEntry | None],
                            nodes: dict[str, NodeInfo]) -> list[IndexEntry | None]:
        """``entries`` with those of nodes not in ``nodes`` turned into misses (their
        connections dropped, segments unmapped, index entries removed)."""
        dead = {e.node_id for e in entries if e is not None and e.node_id not in nodes}
        if not dead:
            return entries
        for node_id in dead:
            self.conns.drop_node(node_id)  # also unmaps its segment
        await self.forget([(k.redis_key, e) for k, e in zip(keys, entries, strict=True)
                           if e is not None and e.node_id in dead])
        return [None if e is None or e.node_id in dead else e for e in entries]

    async def forget(self, gone: Sequence[tuple[str, IndexEntry]]) -> None:
        """Remove index entries (index key, entry) whose payload is gone (dead node,
        evicted, bad checksum), each only if it is still exactly the entry read (a
        fresh put wins). Redis unreachable: logged, not raised."""
        if not gone:
            return
        keys = [k for k, _ in gone]
        try:
            await self._commit(keys=keys, args=[len(keys), *(e.encode() for _, e in gone)])
        except (RedisError, OSError) as exc:
            logger.warning("could not remove %d stale index entries: %s", len(keys), exc)

    async def _entries_or_misses(self, keys: Sequence[BlockKey],
                                 op: str) -> list[IndexEntry | None]:
        """Live index entries of ``keys``; all misses (logged) when the index is unreachable."""
        self.check_open()
        checked = self.check_keys(keys)
        try:
            entries, _ = await self.index(checked)
        except (RedisError, OSError, KVStoreError) as exc:
            logger.warning("%s: index unreachable, reporting misses: %s", op, exc)
            return [None] * len(checked)
        return entries

    async def lookup(self, keys: Sequence[BlockKey]) -> int:
        """:meth:`BlockStore.lookup <tandem.kvstore.store.BlockStore.lookup>` as a coroutine."""
        return leading_count(await self._entries_or_misses(keys, "lookup"))

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is present (not just the leading ones). Index unreachable: all
        False. Raises ValueError on a bad key."""
        return [e is not None for e in await self._entries_or_misses(keys, "contains")]

    # -- put ----------------------------------------------------------------------------------

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[object],
                  ttl_s: float | None = None, *,
                  trace_headers: Mapping[str, str] | None = None) -> int:
        """:meth:`BlockStore.put_blocks <tandem.kvstore.store.BlockStore.put_blocks>` as a
        coroutine; ``trace_headers`` (W3C ``traceparent``): the node's span
        of this put joins that trace (``kvstore/protocol.py``'s ``trace``)."""
        self.check_open()
        keys = self.check_keys(keys)
        views = self.byte_views(blocks, len(keys), writable=False, name="blocks")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not keys:
            return 0
        sizes_by_fp: dict[bytes, int] = {}
        for i, (k, v) in enumerate(zip(keys, views, strict=True)):
            if sizes_by_fp.setdefault(k.layout_fingerprint, v.nbytes) != v.nbytes:
                raise ValueError(f"blocks[{i}] has {v.nbytes} bytes, other blocks of its "
                                 f"layout have {sizes_by_fp[k.layout_fingerprint]}")
        node = self._choose_node(await self._live_nodes_cached(), sum(v.nbytes for v in views))
        try:
            conn = await self.conns.get(node)
        except KVStoreNodeDownError as exc:
            self.mark_down(node, exc)
            raise
        request_id = next_request_id()
        msg: dict[str, object] = {"op": "put", "keys": [k.redis_key for k in keys],
               "sizes": [v.nbytes for v in views],
               "checksums": [checksum(v) for v in views], "ttl_s": ttl_s, "runs": runs_of(views)}
        if trace_headers:
            msg["trace"] = dict(trace_headers)

        async def run() -> dict[str, object]:
            reply = await conn.request(request_id, msg)
            raise_if_error(reply, node)
            done = asyncio.ensure_future(conn.next_reply(request_id))
            sends = [conn.ep.send(span_of(views, i, n),
                                  tag=proto.make_tag(conn.peer_id, request_id, i),
                                  force_tag=True) for i, n in reply["msgs"]]
            await asyncio.gather(*sends)
            return await done

        try:
            final = await within(run(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            self.conns.drop(conn)
            raise KVStoreTimeoutError(
                f"put to store node {node.node_id} ({node.address}) timed out after "
                f"{self.timeout_s}s (node dead or overloaded)") from exc
        except KVStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
            self.conns.drop(conn)
            if peer_gone(exc):
                self.mark_down(node, exc)
                raise KVStoreNodeDownError(
                    f"put to store node {node.node_id} failed: {exc!r}") from exc
            raise KVStoreError(f"put to store node {node.node_id} failed: {exc!r}") from exc
        raise_if_error(final, node)
        return int(final["num_stored"])  # type: ignore[call-overload]

    # -- get ----------------------------------------------------------------------------------

    async def get(self, keys: Sequence[BlockKey], into: Sequence[object]) -> int:
        """:meth:`BlockStore.get_blocks <tandem.kvstore.store.BlockStore.get_blocks>` as a
        coroutine."""
        self.check_open()
        keys = self.check_keys(keys)
        views = self.byte_views(into, len(keys), writable=True, name="into")
        try:
            entries, nodes = await self.index(keys)
        except (RedisError, OSError, KVStoreError) as exc:
            logger.warning("get: index unreachable, reporting a miss: %s", exc)
            return 0
        return await self.get_indexed(keys, views, entries, nodes)

    async def get_indexed(self, keys: list[BlockKey], views: list[np.ndarray],
                          entries: list[IndexEntry | None], nodes: dict[str, NodeInfo]) -> int:
        """:meth:`get` once the index was read: ``keys`` and ``views`` checked
        (:meth:`check_keys`, :meth:`byte_views`), ``entries`` and ``nodes`` as a
        lookup answered them (entries of dead nodes allowed: misses, cleaned up).
        Each node's blocks go through its reader, several nodes at once; the blocks
        of a node found gone (:meth:`node_gone`) are misses, their entries kept.

        Raises:
            as :meth:`get`.
        """
        entries = without_down(await self._without_dead(keys, entries, nodes), nodes,
                               self.down)
        n, by_node = leading_by_node(entries, views)
        work = [self._read(nodes[nid], idx, keys, views, entries) for nid, idx in by_node.items()]
        # NOTE: one node (the common case) is awaited in this task: gather would
        # wrap it in a task of its own, one more trip through the loop
        results = [await work[0]] if len(work) == 1 else await asyncio.gather(*work)
        loaded: dict[int, bool | None] = {}
        unavailable: set[int] = set()
        for idx, r in zip(by_node.values(), results, strict=True):
            if r is None:
                unavailable.update(idx)
            else:
                loaded.update(r)
        count, stale = self.tally(keys, views, entries, n, loaded, unavailable)
        await self.forget(stale)
        return count

    async def _read(self, node: NodeInfo, idx: list[int], keys: list[BlockKey],
                    views: list[np.ndarray],
                    entries: list[IndexEntry | None]) -> dict[int, bool | None] | None:
        """Blocks ``idx`` from one node: index -> checksum verdict (``None``: not
        checked yet) for each that arrived; ``None`` when the node is gone (marked
        down: all of them are misses)."""
        if self.node_gone(node):
            return None
        mine = [views[i] for i in idx]
        names = [keys[i].redis_key for i in idx]
        present = [e for e in (entries[i] for i in idx) if e is not None]
        assert len(present) == len(idx), "only present blocks are read"
        for reader in self.readers.values():
            if not reader.serves(node):
                continue
            try:
                got = await reader.fetch(node, names, mine, present)
            except KVStoreNodeDownError as exc:
                self.mark_down(node, exc)
                return None
            if got is not None:
                return {idx[j]: ok for j, ok in got.items()}
        return None  # no reader serves the node: its blocks are misses, entries kept

    def tally(self, keys: list[BlockKey], views: list[np.ndarray],
              entries: list[IndexEntry | None], n: int,
              loaded: dict[int, bool | None],
              unavailable: Set[int] = frozenset()) -> tuple[int, list[tuple[str, IndexEntry]]]:
        """How many of the first ``n`` blocks arrived intact, and the index entries
        to remove (:meth:`forget`): blocks the node no longer had, and the first
        that failed its checksum. ``loaded``: block index -> checksum verdict
        (``None``: not checked yet, checked here on ``views``); ``unavailable``:
        blocks of nodes found gone (misses whose entries stay: the node's heartbeat
        decides)."""
        stale: list[tuple[str, IndexEntry]] = []
        count = n
        for i in range(n):
            e = entries[i]
            assert e is not None, "leading entries are present"
            if i in unavailable:
                count = min(count, i)
                continue
            if i not in loaded:
                stale.append((keys[i].redis_key, e))  # indexed, not on its node: a miss
                count = min(count, i)
                continue
            if count < i:
                continue
            good = loaded[i]
            if good is None:
                good = checksum(views[i]) == e.checksum
            if not good:
                self.num_checksum_failures += 1
                logger.warning("block %s failed its checksum: treated as a miss", keys[i])
                stale.append((keys[i].redis_key, e))
                count = i
        return count, stale

    # -- the rest -----------------------------------------------------------------------------

    async def stat(self, node_id: str) -> dict[str, object]:
        """A node's statistics (``lru`` keys oldest first, ``num_blocks``, ``pinned``...).

        Raises:
            KVStoreError: node not live, refused, or timed out.
        """
        nodes = await self.live_nodes()
        if node_id not in nodes:
            raise KVStoreError(f"store node {node_id} is not live")
        conn = await self.conns.get(nodes[node_id])
        try:
            reply = await within(conn.request(next_request_id(), {"op": "stat"}),
                                 self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            self.conns.drop(conn)
            raise KVStoreTimeoutError(f"store node {node_id} timed out") from exc
        except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
            self.conns.drop(conn)
            raise KVStoreError(f"request to store node {node_id} failed: {exc!r}") from exc
        raise_if_error(reply, nodes[node_id])
        return reply

    async def aclose(self) -> None:
        """Release connections; further calls raise :class:`KVStoreError`."""
        self._closed = True
        self.conns.close()
        for reader in self.readers.values():
            await asyncio.to_thread(reader.close)  # the same-host reader joins its threads
        await self.redis.aclose()
