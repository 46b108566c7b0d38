"""The store client's coroutines (:class:`AsyncKVStoreClient`, a ``BlockStore``).

Run them on :func:`tandem.kvstore.ucx.client_loop`; :mod:`tandem.kvstore.client`
wraps them for threads. Keys, buffers and semantics: see kvstore/store.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

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
from tandem.kvstore.keys import BlockKey, LayoutFingerprint
from tandem.kvstore.store import BlockStore, KVStoreError, KVStoreNodeError, KVStoreTimeoutError
from tandem.kvstore.transport import (
    NodeConnection,
    NodeInfo,
    checksum,
    next_conn_id,
    next_request_id,
    runs_of,
    span_of,
)
from tandem.kvstore.ucx import byte_view, endpoint_to, within, worker_address

logger = logging.getLogger("tandem.kvstore.client")


class AsyncKVStoreClient(BlockStore):
    """The store client's coroutines; run them on :func:`~tandem.kvstore.ucx.client_loop`.

    Args:
        redis_url: Redis of the block index and node registry.
        layout: if given, every key must carry this layout's fingerprint and every
            block must be ``layout.block_bytes`` long (ValueError otherwise).
        local_node: ``host:port`` (or node id) of the node on this host: puts go
            there while it is alive, else to the least full live node.
        timeout_s: deadline of each node request (connect, put, get).
    """

    def __init__(self, redis_url: str, *, layout: LayoutFingerprint | None = None,
                 local_node: str | None = None, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.layout = layout
        self.local_node = local_node
        self.timeout_s = timeout_s
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

    # -- validation ---------------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        keys = list(keys)
        for i, k in enumerate(keys):
            if not isinstance(k, BlockKey):
                raise ValueError(f"keys[{i}] must be a BlockKey, got {type(k).__name__}")
            if self.layout is not None and k.layout_fingerprint != self.layout.digest:
                raise ValueError(
                    f"keys[{i}] has layout fingerprint {k.layout_fingerprint.hex()}, this "
                    f"client serves {self.layout.digest.hex()} (another model or KV layout)"
                )
        if len(keys) > proto.MAX_BLOCKS_PER_REQUEST:
            raise ValueError(f"keys: at most {proto.MAX_BLOCKS_PER_REQUEST} blocks per call")
        return keys

    def _views(self, blocks: Sequence[Any], n: int, *, writable: bool,
               name: str) -> list[np.ndarray]:
        if len(blocks) != n:
            raise ValueError(f"{name} has {len(blocks)} buffers for {n} keys")
        views = [byte_view(b, writable=writable, name=f"{name}[{i}]") for i, b in enumerate(blocks)]
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
            nodes = {nid: NodeInfo(nid, address, bytes.fromhex(ucx), int(cap), int(used),
                                   int(slot))
                     for nid, address, ucx, cap, used, slot in records}
        except ValueError as exc:
            raise KVStoreError(f"KV store index (Redis) answered a malformed lookup: {exc}") \
                from exc
        # entries of dead nodes are misses, and cleaned up
        await self._forget_many([(k.redis_key, e) for k, e in zip(keys, entries, strict=True)
                                 if e is not None and e.node_id not in nodes])
        return [e if e is not None and e.node_id in nodes else None for e in entries], nodes

    async def lookup(self, keys: Sequence[BlockKey]) -> int:
        self._check_open()
        keys = self._check_keys(keys)
        try:
            entries, _ = await self._index(keys)
        except (RedisError, OSError, KVStoreError) as exc:
            logger.warning("lookup: index unreachable, reporting a miss: %s", exc)
            return 0
        return leading_count(entries)

    async def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is present (not just the leading ones). Index unreachable: all
        False."""
        self._check_open()
        keys = self._check_keys(keys)
        try:
            entries, _ = await self._index(keys)
        except (RedisError, OSError, KVStoreError) as exc:
            logger.warning("contains: index unreachable, reporting misses: %s", exc)
            return [False] * len(keys)
        return [e is not None for e in entries]

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
        try:
            entries, nodes = await self._index(keys)
        except (RedisError, OSError, KVStoreError) as exc:
            logger.warning("get: index unreachable, reporting a miss: %s", exc)
            return 0
        return await self._get_indexed(keys, views, entries, nodes)

    async def _get_indexed(self, keys: list[BlockKey], views: list[np.ndarray],
                           entries: list[IndexEntry | None], nodes: dict[str, NodeInfo]) -> int:
        """:meth:`get` once the index entries are known."""
        n = leading_count(entries)
        by_node: dict[str, list[int]] = {}
        for i in range(n):
            e = entries[i]
            assert e is not None
            if e.size_bytes != views[i].nbytes:
                raise ValueError(f"into[{i}] has {views[i].nbytes} bytes, the stored block has "
                                 f"{e.size_bytes}")
            by_node.setdefault(e.node_id, []).append(i)
        results = await asyncio.gather(
            *(self._get_from(nodes[nid], idx, keys, views, entries)
              for nid, idx in by_node.items()))
        loaded = set().union(*results) if results else set()
        # indexed but not on its node (evicted or lost since): a miss, cleaned up
        await self._forget_many([(keys[i].redis_key, entries[i]) for i in range(n)  # type: ignore[misc]
                                 if i not in loaded])
        count = 0
        for i in range(n):
            if i not in loaded:
                break
            e = entries[i]
            assert e is not None
            if checksum(views[i]) != e.checksum:
                self.num_checksum_failures += 1
                logger.warning("block %s failed its checksum: treated as a miss", keys[i])
                await self._forget(keys[i], e)
                break
            count += 1
        return count

    async def _get_from(self, node: NodeInfo, idx: list[int], keys: list[BlockKey],
                        views: list[np.ndarray],
                        entries: list[IndexEntry | None]) -> set[int]:
        """Fetch blocks ``idx`` from one node; returns the indices that arrived.

        When the node's slot size is known, the receives are posted before the
        request (the cut into messages follows from the index's slots), which saves
        a round trip; if the node's blocks moved since the index was read, it
        answers ``stale`` and sends nothing, and the classic two-step get runs.
        """
        mine = [views[i] for i in idx]
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
                return {i for i, hit in zip(idx, present, strict=True) if hit}
            # stale: cancel the receives posted for the expected cut, then retry
            self.num_stale_gets += 1
            self._drop(conn)
            if expect is None:
                break
        return set()

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
        await self.redis.aclose()


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
