"""The store client's coroutines (:class:`AsyncKVStoreClient`, a ``BlockStore``).

Run them on :func:`tandem.kvstore.ucx.client_loop`; :mod:`tandem.kvstore.client`
wraps them for threads. Keys, buffers and semantics: see kvstore/store.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore import protocol as proto
from tandem.kvstore.index import (
    COMMIT_LUA,
    LOOKUP_LUA,
    NODE_PREFIX,
    NODES_SET,
    IndexEntry,
    node_key,
    parse_lookup,
)
from tandem.kvstore.shm import Mapping, host_id, shm_enabled_by_env
from tandem.kvstore.store import BlockStore, KVStoreError, KVStoreNodeError, KVStoreTimeoutError
from tandem.kvstore.transport import (
    NodeConnection,
    NodeInfo,
    address_of,
    checksum,
    next_conn_id,
    next_request_id,
    runs_of,
    span_of,
)
from tandem.kvstore.ucx import byte_view, endpoint_to, within, worker_address

logger = logging.getLogger("tandem.kvstore.client")

#: shared-memory reads smaller than this are copied by one thread (a hand-off to
#: the pool costs tens of microseconds)
PARALLEL_COPY_MIN_BYTES = 2 << 20


class AsyncKVStoreClient(BlockStore):
    """The store client's coroutines; run them on :func:`~tandem.kvstore.ucx.client_loop`.

    Args:
        redis_url: Redis of the block index and node registry.
        layout: if given, every key must carry this layout's fingerprint and every
            block must be ``layout.block_bytes`` long (ValueError otherwise).
        local_node: ``host:port`` (or node id) of the node on this host: puts go
            there while it is alive, else to the least full live node.
        timeout_s: deadline of each node request (connect, put, get).
        shm: read blocks of nodes on this host straight from their shared-memory
            pool (kvstore/shm.py); ``None``: on unless ``TANDEM_KV_SHM=0``. Other
            nodes, and nodes without a shared pool, are read over UCX.
        copy_threads: threads that copy and checksum a shared-memory read of
            at least ``PARALLEL_COPY_MIN_BYTES`` (``None``: ``TANDEM_KV_COPY_THREADS``,
            default 2). ValueError when < 1.
    """

    def __init__(self, redis_url: str, *, layout: KVCacheLayout | None = None,
                 local_node: str | None = None, timeout_s: float = 10.0,
                 shm: bool | None = None, copy_threads: int | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.layout = layout
        self.local_node = local_node
        self.timeout_s = timeout_s
        self.shm = shm_enabled_by_env() if shm is None else bool(shm)
        # node id -> its mapped segment, or None when it cannot be mapped from here
        self._maps: dict[str, tuple[str, Mapping | None]] = {}
        self._releases: set[asyncio.Future[Any]] = set()
        self.redis = aioredis.from_url(redis_url, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s)
        self._commit = self.redis.register_script(COMMIT_LUA)
        self._lookup = self.redis.register_script(LOOKUP_LUA)
        self._nodes_cache: tuple[float, dict[str, NodeInfo]] | None = None
        self._conns: dict[str, NodeConnection] = {}
        self._conn_locks: dict[str, asyncio.Lock] = {}
        self._closed = False
        self.num_checksum_failures = 0
        #: gets whose receives were posted before the request (one round trip saved)
        self.num_fast_gets = 0
        #: of those, answered ``stale`` (index older than the node's slots) and redone
        self.num_stale_gets = 0
        #: node requests served from a shared-memory segment (kvstore/shm.py)
        self.num_shm_gets = 0
        #: of those, served by a request sent together with the index lookup
        self.num_speculative_gets = 0
        self._shm_node: NodeInfo | None = None  # the last node read through shared memory
        if copy_threads is None:
            copy_threads = int(os.environ.get("TANDEM_KV_COPY_THREADS", "2"))
        if copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self.copy_threads = copy_threads
        self._copy_pool: ThreadPoolExecutor | None = None
        self._copy_pool_lock = threading.Lock()

    # -- validation ---------------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        keys = list(keys)
        for i, k in enumerate(keys):
            if not isinstance(k, BlockKey):
                raise ValueError(f"keys[{i}] must be a BlockKey, got {type(k).__name__}")
            if self.layout is not None and k.layout_fingerprint != self.layout.fingerprint:
                raise ValueError(
                    f"keys[{i}] has layout fingerprint {k.layout_fingerprint.hex()}, this "
                    f"client serves {self.layout.fingerprint.hex()} (another model or KV layout)"
                )
        if len(keys) > proto.MAX_BLOCKS_PER_REQUEST:
            raise ValueError(f"keys: at most {proto.MAX_BLOCKS_PER_REQUEST} blocks per call")
        return keys

    def _views(self, blocks: Sequence[Any], n: int, *, writable: bool,
               name: str) -> list[np.ndarray]:
        if len(blocks) != n:
            raise ValueError(f"{name} has {len(blocks)} buffers for {n} keys")
        views = [byte_view(b, writable=writable, name=f"{name}[{i}]") for i, b in enumerate(blocks)]
        if writable and len(views) > 1:
            # two blocks landing in one buffer would fail their checksums, and a
            # checksum failure removes the (intact) block from the shared index
            spans = sorted((address_of(v), v.nbytes, i) for i, v in enumerate(views))
            for (a0, n0, i0), (a1, _, i1) in zip(spans, spans[1:], strict=False):
                if a1 < a0 + n0:
                    raise ValueError(f"{name}[{min(i0, i1)}] and {name}[{max(i0, i1)}] overlap: "
                                     "each block needs a buffer of its own")
        for i, v in enumerate(views):
            if v.nbytes == 0:
                raise ValueError(f"{name}[{i}] is empty")
            if self.layout is not None and v.nbytes != self.layout.block_bytes:
                raise ValueError(
                    f"{name}[{i}] has {v.nbytes} bytes, the layout's blocks have "
                    f"{self.layout.block_bytes} (wrong block size)"
                )
        return views

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("client is closed")

    # -- registry / connections ---------------------------------------------------------------

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
        for gone in self._maps.keys() - nodes.keys():
            del self._maps[gone]  # a dead node's segment lives while we map it
        return nodes

    async def _live_nodes_cached(self) -> dict[str, NodeInfo]:
        """:meth:`live_nodes`, reused for up to a second (the put policy needs only a
        recent view; a node that died since then costs one put timeout)."""
        now = time.monotonic()
        if self._nodes_cache is None or now - self._nodes_cache[0] > 1.0:
            self._nodes_cache = (now, await self.live_nodes())
        return self._nodes_cache[1]

    async def _conn(self, node: NodeInfo) -> NodeConnection:
        lock = self._conn_locks.setdefault(node.node_id, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node.node_id)
            if conn is not None and not conn.closed and conn.ucx_address == node.ucx_address:
                return conn
            if conn is not None:
                conn.abort()  # the node restarted (new address) or the connection failed
            ep = await endpoint_to(node.ucx_address)
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
        self._drop(conn)

    def _drop(self, conn: NodeConnection) -> None:
        self._nodes_cache = None
        conn.abort()
        node_id = conn.node_id
        # NOTE: a dead node's segment lives while mapped: map it afresh next time
        self._maps.pop(node_id, None)
        if self._conns.get(node_id) is conn:
            del self._conns[node_id]

    def _choose_node(self, nodes: dict[str, NodeInfo], nbytes: int) -> NodeInfo:
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

    # -- BlockStore ---------------------------------------------------------------------------

    async def _index(self, keys: list[BlockKey]) -> tuple[list[IndexEntry | None],
                                                          dict[str, NodeInfo]]:
        """Index entries of ``keys`` with dead nodes' entries turned into misses."""
        if not keys:
            return [], {}
        reply = await self._lookup(keys=[k.redis_key for k in keys], args=[NODE_PREFIX])
        try:
            entries, records = parse_lookup(len(keys), reply)
            nodes = {r[0]: NodeInfo.from_lookup(r) for r in records}
        except ValueError as exc:
            raise KVStoreError(f"KV store index (Redis) answered a malformed lookup: {exc}") \
                from exc
        # entries of dead nodes are misses, and cleaned up (and their segments unmapped)
        for dead in {e.node_id for e in entries if e is not None and e.node_id not in nodes}:
            self._maps.pop(dead, None)
            conn = self._conns.get(dead)
            if conn is not None:
                self._drop(conn)  # also fails a speculative get_shm sent to it at once
        await self._forget_many([(k.redis_key, e) for k, e in zip(keys, entries, strict=True)
                                 if e is not None and e.node_id not in nodes])
        return [e if e is not None and e.node_id in nodes else None for e in entries], nodes

    async def lookup(self, keys: Sequence[BlockKey]) -> int:
        return leading_count(await self._entries_or_misses(keys, "lookup"))

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is present (not just the leading ones). Index unreachable: all
        False."""
        return [e is not None for e in await self._entries_or_misses(keys, "contains")]

    async def _entries_or_misses(
        self, keys: Sequence[BlockKey], op: str
    ) -> list[IndexEntry | None]:
        """Live index entries of ``keys``; all misses (logged) when the index is unreachable."""
        self._check_open()
        keys = self._check_keys(keys)
        try:
            entries, _ = await self._index(keys)
        except (RedisError, OSError, KVStoreError) as exc:
            logger.warning("%s: index unreachable, reporting misses: %s", op, exc)
            return [None] * len(keys)
        return entries

    async def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any],
                  ttl_s: float | None = None) -> int:
        self._check_open()
        keys = self._check_keys(keys)
        views = self._views(blocks, len(keys), writable=False, name="blocks")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if not keys:
            return 0
        sizes_by_fp: dict[bytes, int] = {}
        for i, (k, v) in enumerate(zip(keys, views, strict=True)):
            if sizes_by_fp.setdefault(k.layout_fingerprint, v.nbytes) != v.nbytes:
                raise ValueError(f"blocks[{i}] has {v.nbytes} bytes, other blocks of its "
                                 f"layout have {sizes_by_fp[k.layout_fingerprint]}")
        total = sum(v.nbytes for v in views)
        node = self._choose_node(await self._live_nodes_cached(), total)
        conn = await self._conn(node)
        request_id = next_request_id()
        msg = {"op": "put", "keys": [k.redis_key for k in keys],
               "sizes": [v.nbytes for v in views],
               "checksums": [checksum(v) for v in views], "ttl_s": ttl_s, "runs": runs_of(views)}

        async def run() -> dict[str, Any]:
            reply = await conn.request(request_id, msg)
            _raise_if_error(reply, node)
            done = asyncio.ensure_future(conn.next_reply(request_id))
            sends = [conn.ep.send(span_of(views, i, n),
                                  tag=proto.make_tag(conn.peer_id, request_id, i),
                                  force_tag=True) for i, n in reply["msgs"]]
            await asyncio.gather(*sends)
            return await done

        try:
            final = await within(run(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            self._drop(conn)
            raise KVStoreTimeoutError(
                f"put to store node {node.node_id} ({node.address}) timed out after "
                f"{self.timeout_s}s (node dead or overloaded)") from exc
        except KVStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
            self._drop(conn)
            raise KVStoreError(f"put to store node {node.node_id} failed: {exc!r}") from exc
        _raise_if_error(final, node)
        return int(final["num_stored"])

    async def get(self, keys: Sequence[BlockKey], into: Sequence[Any]) -> int:
        self._check_open()
        keys = self._check_keys(keys)
        views = self._views(into, len(keys), writable=True, name="into")
        spec = self._speculate(keys)
        try:
            entries, nodes = await self._index(keys)
        except BaseException as exc:
            if spec is not None:
                self._abandon(spec)
            if isinstance(exc, RedisError | OSError | KVStoreError):
                logger.warning("get: index unreachable, reporting a miss: %s", exc)
                return 0
            raise
        return await self._get_indexed(keys, views, entries, nodes, spec)

    async def _get_indexed(self, keys: list[BlockKey], views: list[np.ndarray],
                           entries: list[IndexEntry | None], nodes: dict[str, NodeInfo],
                           spec: _Speculation | None = None) -> int:
        """:meth:`get` once the index entries are known (``spec``: see :meth:`_speculate`)."""
        try:
            return await self._get_indexed_inner(keys, views, entries, nodes, spec)
        finally:
            if spec is not None and not spec.used:
                self._abandon(spec)

    async def _get_indexed_inner(self, keys: list[BlockKey], views: list[np.ndarray],
                                 entries: list[IndexEntry | None], nodes: dict[str, NodeInfo],
                                 spec: _Speculation | None) -> int:
        n, by_node = leading_by_node(entries, views)
        work = [self._get_spec(spec, nodes[nid], idx, keys, views, entries)
                if spec is not None and self._spec_fits(spec, nodes[nid])
                else self._get_from(nodes[nid], idx, keys, views, entries)
                for nid, idx in by_node.items()]
        # NOTE: one node (the common case) is awaited in this task: gather would
        # wrap it in a task of its own, one more trip through the loop
        results = [await work[0]] if len(work) == 1 else await asyncio.gather(*work)
        loaded: dict[int, bool | None] = {}
        for r in results:
            loaded.update(r)
        # indexed but not on its node (evicted or lost since): a miss, cleaned up
        await self._forget_many([(keys[i].redis_key, entries[i]) for i in range(n)  # type: ignore[misc]
                                 if i not in loaded])
        count, bad = self.count_loaded(keys, views, entries, n, loaded)
        if bad is not None:
            await self._forget(keys[bad], entries[bad])  # type: ignore[arg-type]
        return count

    def count_loaded(self, keys: list[BlockKey], views: list[np.ndarray],
                     entries: list[IndexEntry | None], n: int,
                     loaded: dict[int, bool | None]) -> tuple[int, int | None]:
        """How many of the first ``n`` blocks arrived intact, and the index of the
        block that failed its checksum (``None``: none did). ``loaded``: block
        index -> checksum verdict (``None``: not checked yet, checked here)."""
        for i in range(n):
            if i not in loaded:
                return i, None
            e = entries[i]
            assert e is not None
            good = loaded[i]
            if good is None:
                good = checksum(views[i]) == e.checksum
            if not good:
                self.num_checksum_failures += 1
                logger.warning("block %s failed its checksum: treated as a miss", keys[i])
                return i, i
        return n, None

    async def _get_from(self, node: NodeInfo, idx: list[int], keys: list[BlockKey],
                        views: list[np.ndarray],
                        entries: list[IndexEntry | None]) -> dict[int, bool | None]:
        """Fetch blocks ``idx`` from one node; returns the indices that arrived, each
        with whether its checksum matched (``None``: not checked yet).

        When the node's slot size is known, the receives are posted before the
        request (the cut into messages follows from the index's slots), which saves
        a round trip; if the node's blocks moved since the index was read, it
        answers ``stale`` and sends nothing, and the classic two-step get runs.
        """
        mine = [views[i] for i in idx]
        mapping = self._mapping(node)
        if mapping is not None:
            return await self._get_shm(node, mapping, idx, keys, mine, entries)
        runs = runs_of(mine)
        request = {"op": "get", "keys": [keys[i].redis_key for i in idx], "runs": runs}
        msgs = None
        if node.slot_bytes:
            slots: list[int | None] = [entries[i].slot for i in idx]  # type: ignore[union-attr]
            sizes = [entries[i].size_bytes for i in idx]  # type: ignore[union-attr]
            msgs = proto.group_messages(runs, slots, sizes, node.slot_bytes)
        for attempt in (0, 1):
            conn = await self._conn(node)
            request_id = next_request_id()

            expect = msgs if attempt == 0 else None
            try:
                present = await within(
                    self._get_once(conn, request_id, node, mine, request, expect), self.timeout_s)
            except (TimeoutError, asyncio.TimeoutError) as exc:
                # NOTE: aborting the endpoint cancels the posted receives, so nothing is
                # written into the caller's buffers after we return.
                self._drop(conn)
                raise KVStoreTimeoutError(
                    f"get from store node {node.node_id} ({node.address}) timed out after "
                    f"{self.timeout_s}s (node dead or overloaded)") from exc
            except KVStoreError:
                self._drop(conn)  # cancels receives posted for an expected cut
                raise
            except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
                self._drop(conn)
                raise KVStoreError(
                    f"get from store node {node.node_id} failed: {exc!r}") from exc
            if present is not None:
                self.num_fast_gets += expect is not None
                return {i: None for i, hit in zip(idx, present, strict=True) if hit}
            # stale: cancel the receives posted for the expected cut, then retry
            self.num_stale_gets += 1
            self._drop(conn)
            if expect is None:
                break
        return {}

    async def _get_once(self, conn: NodeConnection, request_id: int, node: NodeInfo,
                        mine: list[np.ndarray], request: dict[str, Any],
                        expect: list[tuple[int, int]] | None) -> list[bool] | None:
        """One get request; ``None`` when the node answered ``stale``."""
        def post(cut: list[Any]) -> list[asyncio.Future[Any]]:
            return [asyncio.ensure_future(conn.ep.recv(
                span_of(mine, j, n), tag=proto.make_tag(conn.my_id, request_id, j),
                force_tag=True)) for j, n in cut]

        recvs = post(expect) if expect is not None else []
        msg = dict(request, msgs=expect) if expect is not None else request
        reply = await conn.request(request_id, msg)
        _raise_if_error(reply, node)
        if reply.get("stale"):
            return None
        if expect is None:
            recvs = post(reply["msgs"])
        await asyncio.gather(*recvs)
        return [bool(p) for p in reply["present"]]

    # -- same-host shared-memory reads (kvstore/shm.py) ----------------------------------------

    def _mapping(self, node: NodeInfo) -> Mapping | None:
        """The node's segment mapped read-only, ``None`` if it must be read over UCX."""
        if not (self.shm and node.shm_path and node.shm_id and node.host_id == host_id()):
            return None
        ident = f"{node.shm_path}|{node.shm_id}"
        cached = self._maps.get(node.node_id)
        if cached is not None and cached[0] == ident:
            return cached[1]
        try:
            mapping: Mapping | None = Mapping(node.shm_path, node.shm_id)
        except (OSError, ValueError) as exc:
            logger.info("store node %s: cannot map its shared pool (%s); reading over UCX",
                        node.node_id, exc)
            mapping = None
        self._maps[node.node_id] = (ident, mapping)
        return mapping

    async def _shm_request(self, conn: NodeConnection, node: NodeInfo,
                           keys: list[str]) -> dict[str, Any]:
        """Send ``get_shm`` for ``keys`` and return the node's reply (see protocol.py)."""
        try:
            reply = await within(conn.request(next_request_id(), {"op": "get_shm", "keys": keys}),
                                 self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            self._drop(conn)
            raise KVStoreTimeoutError(
                f"get from store node {node.node_id} ({node.address}) timed out after "
                f"{self.timeout_s}s (node dead or overloaded)") from exc
        except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
            self._drop(conn)
            raise KVStoreError(f"get from store node {node.node_id} failed: {exc!r}") from exc
        _raise_if_error(reply, node)
        offsets, sizes = reply.get("offsets"), reply.get("sizes")
        if not (isinstance(offsets, list) and isinstance(sizes, list)
                and len(offsets) == len(sizes) == len(keys)):
            if reply.get("lease"):
                self._release(conn, reply["lease"])
            raise KVStoreError(f"store node {node.node_id} answered a malformed get_shm")
        return reply

    async def _get_shm(self, node: NodeInfo, mapping: Mapping, idx: list[int],
                       keys: list[BlockKey], mine: list[np.ndarray],
                       entries: list[IndexEntry | None]) -> dict[int, bool | None]:
        """:meth:`_get_from` for a node on this host: the node pins the blocks and
        answers with their offsets in its segment; we copy them straight into
        ``mine`` (:meth:`_copy_shm`) and release the pins."""
        conn = await self._conn(node)
        reply = await self._shm_request(conn, node, [keys[i].redis_key for i in idx])
        try:
            good = verdicts(self._copy_shm(mapping, reply["offsets"], reply["sizes"], idx, mine),
                            entries)
        finally:
            if reply.get("lease"):
                self._release(conn, reply["lease"])
        self.num_shm_gets += 1
        self._shm_node = node
        return good

    def _copy_shm(self, mapping: Mapping, offsets: list[int], sizes: list[int], idx: list[int],
                  mine: list[np.ndarray]) -> dict[int, str]:
        """Copy blocks ``idx`` (at ``offsets[j]``, ``sizes[j]`` in the segment; -1: absent)
        into ``mine[j]``; returns the indices copied, each with the checksum
        (:func:`~tandem.kvstore.transport.checksum`) of the bytes that landed.

        Blocks adjacent on both sides (a run of consecutive cache blocks in
        consecutive slots) move in one copy; then each block's checksum is verified
        on the bytes that landed in ``mine``.

        NOTE: one copy per run, not per block: glibc copies of up to the L2 size
        (512 KiB on AMD Zen) use ``rep movsb``, which ran 3x slower here when the
        destination is not 64-byte aligned relative to the (page-aligned) slot, as
        numpy's 16-byte-aligned arrays are (torch's are 64-byte aligned); larger
        copies use vector loops that do not care. Copying in 1-4 MiB pieces and
        hashing each while still cached gained nothing measurable. Large reads are
        split into ``copy_threads`` shares of about equal bytes (at block
        boundaries), each copied then checksummed by its own thread: one core's
        memory bandwidth was the limit.
        """
        # a block is copied only where the node has it, with the size we expect,
        # inside the segment
        ok = [isinstance(o, int) and isinstance(n, int) and 0 <= o and n == v.nbytes
              and o + n <= mapping.nbytes for o, n, v in zip(offsets, sizes, mine, strict=True)]
        pieces: list[list[int]] = []  # each: blocks adjacent on both sides, one copy
        for start, count in runs_of(mine):
            j, end = start, start + count
            while j < end:
                if not ok[j]:
                    j += 1
                    continue
                k, stop = j, offsets[j] + sizes[j]
                while k + 1 < end and ok[k + 1] and offsets[k + 1] == stop:
                    k += 1
                    stop += sizes[k]
                pieces.append(list(range(j, k + 1)))
                j = k + 1
        src = mapping.array

        def work(share: list[list[int]]) -> dict[int, str]:
            for piece in share:
                first, last = piece[0], piece[-1]
                np.copyto(span_of(mine, first, len(piece)),
                          src[offsets[first]:offsets[last] + sizes[last]])
            return {idx[j]: checksum(mine[j]) for piece in share for j in piece}

        shares = split_shares(pieces, sizes, self._copy_workers(sum(sizes[j] for p in pieces
                                                                     for j in p)))
        # NOTE: numpy's copy and xxhash both release the GIL, so the shares run
        # in parallel; this thread does the first, the pool the others.
        pool, futures = self._copy_pool, []
        for sh in shares[1:]:
            try:
                futures.append(pool.submit(work, sh))  # type: ignore[union-attr]
            except (AttributeError, RuntimeError):  # closed meanwhile: copy it here
                futures.append(_done(work(sh)))
        good = work(shares[0]) if shares else {}
        for fut in futures:
            good.update(fut.result())
        return good

    def _copy_workers(self, nbytes: int) -> int:
        """How many threads copy-and-checksum ``nbytes`` of shared-memory reads."""
        if self.copy_threads <= 1 or nbytes < PARALLEL_COPY_MIN_BYTES or self._closed:
            return 1
        with self._copy_pool_lock:  # gets also run on callers' threads (kvstore/shm_read.py)
            if self._copy_pool is None:
                self._copy_pool = ThreadPoolExecutor(self.copy_threads - 1,
                                                     thread_name_prefix="tandem-kv-copy")
        return self.copy_threads

    # NOTE: speculation. A get's Redis lookup and its get_shm request to the node
    # that served the previous shared-memory get are sent together, instead of one
    # after the other (each costs a few hundred us of wake-ups on a busy host).
    # The reply is used only for the blocks the index places on that node, and
    # only if the node holds every one of them (a block committed to the index
    # but not yet marked committed on the node is never taken for a miss); else
    # it is released and the plain get runs.

    def _speculate(self, keys: list[BlockKey]) -> _Speculation | None:
        """Start a ``get_shm`` of ``keys`` to the last node read through shared memory."""
        node = self._shm_node
        if node is None or not self.shm or not keys:
            return None
        conn = self._conns.get(node.node_id)
        cached = self._maps.get(node.node_id)
        if (conn is None or conn.closed or conn.ucx_address != node.ucx_address
                or cached is None or cached[1] is None):
            return None
        fut = asyncio.ensure_future(self._shm_request(conn, node, [k.redis_key for k in keys]))
        return _Speculation(node, conn, cached[1], fut)

    def _spec_fits(self, spec: _Speculation, node: NodeInfo) -> bool:
        """Whether ``spec`` went to ``node`` as the index describes it now."""
        return (spec.node.node_id == node.node_id and spec.node.ucx_address == node.ucx_address
                and not spec.conn.closed and self._mapping(node) is spec.mapping)

    async def _get_spec(self, spec: _Speculation, node: NodeInfo, idx: list[int],
                        keys: list[BlockKey], views: list[np.ndarray],
                        entries: list[IndexEntry | None]) -> dict[int, bool | None]:
        """:meth:`_get_shm` with the speculative request's reply."""
        spec.used = True
        reply = await spec.fut
        lease = reply.get("lease")
        try:
            offsets = [reply["offsets"][i] for i in idx]
            if not all(isinstance(o, int) and o >= 0 for o in offsets):
                if lease:
                    self._release(spec.conn, lease)
                    lease = None
                return await self._get_from(node, idx, keys, views, entries)
            sizes = [reply["sizes"][i] for i in idx]
            good = verdicts(self._copy_shm(spec.mapping, offsets, sizes, idx,
                                           [views[i] for i in idx]), entries)
        finally:
            if lease:
                self._release(spec.conn, lease)
        self.num_shm_gets += 1
        self.num_speculative_gets += 1
        return good

    def _abandon(self, spec: _Speculation) -> None:
        """Release an unused speculative request's pins once its reply is in."""
        spec.used = True

        def done(fut: asyncio.Future[dict[str, Any]]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                return  # its connection was dropped (and the node's lease expires)
            lease = fut.result().get("lease")
            if lease:
                self._release(spec.conn, lease)

        spec.fut.add_done_callback(done)

    def _release(self, conn: NodeConnection, lease: int) -> None:
        """Tell the node a shared-memory read is done (no reply; if it never arrives,
        the node unpins at the lease's expiry)."""
        if conn.closed:
            return
        msg = proto.encode({"op": "release", "req": next_request_id(), "lease": lease})
        try:
            fut = asyncio.ensure_future(conn.ep.send(
                msg, tag=proto.make_tag(conn.peer_id, 0xFFFFFF, proto.CTRL_PART),
                force_tag=True))
        except Exception as exc:  # noqa: BLE001 - endpoint unusable: the lease expires
            logger.debug("release not sent (the lease expires instead): %r", exc)
            return
        self._releases.add(fut)
        fut.add_done_callback(_release_done(self._releases))

    async def _forget(self, key: BlockKey, entry: IndexEntry) -> None:
        """Remove a bad block's index entry (see :meth:`_forget_many`)."""
        await self._forget_many([(key.redis_key, entry)])

    async def _forget_many(self, gone: list[tuple[str, IndexEntry]]) -> None:
        """Remove index entries whose payload is gone (dead node, evicted, bad checksum),
        each only if it is still exactly the entry we read (a fresh put wins)."""
        if not gone:
            return
        keys = [k for k, _ in gone]
        try:
            await self._commit(keys=keys, args=[len(keys), *(e.encode() for _, e in gone)])
        except (RedisError, OSError) as exc:
            logger.warning("could not remove %d stale index entries: %s", len(keys), exc)

    async def node_request(self, node_id: str, msg: dict[str, Any]) -> dict[str, Any]:
        """Send one control request (``stat``, or the test hook ``corrupt``) to a node.

        Raises:
            KVStoreError: node not live, refused, or timed out.
        """
        nodes = await self.live_nodes()
        if node_id not in nodes:
            raise KVStoreError(f"store node {node_id} is not live")
        conn = await self._conn(nodes[node_id])
        async def run() -> dict[str, Any]:
            return await conn.request(next_request_id(), msg)

        try:
            reply = await within(run(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            self._drop(conn)
            raise KVStoreTimeoutError(f"store node {node_id} timed out") from exc
        except KVStoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - UCX failure: connection unusable
            self._drop(conn)
            raise KVStoreError(f"request to store node {node_id} failed: {exc!r}") from exc
        _raise_if_error(reply, nodes[node_id])
        return reply

    async def aclose(self) -> None:
        self._closed = True
        for c in list(self._conns.values()):
            self._drop(c)
        if self._copy_pool is not None:
            self._copy_pool.shutdown(wait=True)
            self._copy_pool = None
        await self.redis.aclose()


class _Speculation:
    """A ``get_shm`` sent before the index lookup answered (see ``_speculate``)."""

    def __init__(self, node: NodeInfo, conn: NodeConnection, mapping: Mapping,
                 fut: asyncio.Future[dict[str, Any]]) -> None:
        self.node = node
        self.conn = conn
        self.mapping = mapping
        self.fut = fut
        self.used = False  # its reply is (being) used or released


def _release_done(pending: set[asyncio.Future[Any]]) -> Any:
    def done(fut: asyncio.Future[Any]) -> None:
        pending.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            logger.debug("release not sent (the lease expires instead): %r", fut.exception())
    return done


def _done(result: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(result)
    return fut


def split_shares(pieces: list[list[int]], sizes: list[int], n: int) -> list[list[list[int]]]:
    """Cut copy ``pieces`` (lists of adjacent block indices, ``sizes[j]`` bytes each)
    into at most ``n`` shares of about equal bytes, splitting a piece only
    between blocks. Every block lands in exactly one share, order kept."""
    total = sum(sizes[j] for p in pieces for j in p)
    shares: list[list[list[int]]] = []
    done, at = 0, -1
    for piece in pieces:
        cur: list[int] = []
        for j in piece:
            share = min(n - 1, done * n // total) if n > 1 else 0
            if share != at:  # a new share starts at this block
                if cur:
                    shares[-1].append(cur)
                    cur = []
                shares.append([])
                at = share
            cur.append(j)
            done += sizes[j]
        if cur:
            shares[-1].append(cur)
    return shares


def verdicts(sums: dict[int, str],
             entries: Sequence[IndexEntry | None]) -> dict[int, bool | None]:
    """Block index -> whether the checksum of its copied bytes is the index's."""
    out: dict[int, bool | None] = {}
    for i, h in sums.items():
        e = entries[i]
        assert e is not None
        out[i] = h == e.checksum
    return out


def leading_by_node(entries: Sequence[IndexEntry | None],
                    views: Sequence[np.ndarray]) -> tuple[int, dict[str, list[int]]]:
    """The number of leading present blocks, and their indices grouped by node id.

    Raises:
        ValueError: a buffer's size is not its stored block's.
    """
    n = leading_count(entries)
    by_node: dict[str, list[int]] = {}
    for i in range(n):
        e = entries[i]
        assert e is not None
        if e.size_bytes != views[i].nbytes:
            raise ValueError(f"into[{i}] has {views[i].nbytes} bytes, the stored block has "
                             f"{e.size_bytes}")
        by_node.setdefault(e.node_id, []).append(i)
    return n, by_node


def leading_count(entries: Sequence[IndexEntry | None]) -> int:
    n = 0
    for e in entries:
        if e is None:
            break
        n += 1
    return n


def _raise_if_error(reply: dict[str, Any], node: NodeInfo) -> None:
    if reply.get("op") == "error":
        raise KVStoreNodeError(f"store node {node.node_id} ({node.address}): {reply['error']}")
