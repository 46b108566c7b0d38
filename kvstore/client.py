"""Client of the tandem KV store: what the engine's KV connector calls.

Usage (from any thread except the store's own loop thread; calls block the
caller, never the engine's step loop if made from a transfer thread)::

    from tandem.kvstore.client import KVStoreClient
    from tandem.kvstore.keys import BlockKey

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

Inside an event loop use :class:`AsyncKVStoreClient` (a
:class:`~tandem.kvstore.store.BlockStore`) on the loop of
:func:`tandem.kvstore.ucx.client_loop`; the synchronous facade runs exactly
those coroutines there, so the two never drift apart.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis
import xxhash
from redis.exceptions import RedisError

from tandem.kvstore import protocol as proto
from tandem.kvstore.index import (
    COMMIT_LUA,
    LOOKUP_LUA,
    NODE_PREFIX,
    NODES_SET,
    IndexEntry,
    node_key,
)
from tandem.kvstore.keys import BlockKey, LayoutFingerprint
from tandem.kvstore.store import BlockStore, KVStoreError, KVStoreNodeError, KVStoreTimeoutError
from tandem.kvstore.ucx import byte_view, client_loop, endpoint_to, worker_address

__all__ = [
    "AsyncKVStoreClient", "BlockKey", "KVStoreClient", "KVStoreError", "KVStoreNodeError",
    "KVStoreTimeoutError", "LayoutFingerprint", "connect_sync",
]

logger = logging.getLogger("tandem.kvstore.client")

# NOTE: every client of the process shares one UCX worker, so connection and
# request ids (parts of the receive tags) are process-wide.
_conn_ids = itertools.count(1)
_request_ids = itertools.count(1)


def _next_conn_id() -> int:
    return next(_conn_ids) % 0xFFFE + 1


def _next_request_id() -> int:
    return next(_request_ids) % (proto.CTRL_PART - 1) + 1


def _address(view: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0])


def _span(views: list[np.ndarray], first: int, count: int) -> np.ndarray:
    """One uint8 array over ``views[first:first + count]``, which are adjacent in memory.

    NOTE: built from the address; valid while the caller's buffers live, i.e.
    for the duration of the transfer that uses it.
    """
    if count == 1:
        return views[first]
    nbytes = sum(v.nbytes for v in views[first : first + count])
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(_address(views[first])))


def _runs(views: list[np.ndarray]) -> list[list[int]]:
    return proto.adjacent_runs([_address(v) for v in views], [v.nbytes for v in views])


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

    @classmethod
    def from_hash(cls, node_id: str, h: dict[bytes, bytes]) -> NodeInfo | None:
        try:
            return cls(node_id, h[b"address"].decode(), bytes.fromhex(h[b"ucx_address"].decode()),
                       int(h[b"capacity_bytes"]), int(h[b"used_bytes"]),
                       int(h.get(b"slot_bytes", b"0")))
        except (KeyError, ValueError):
            return None


class _Conn:
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

    async def request(self, request_id: int, msg: dict[str, Any]) -> asyncio.Future[Any]:
        """Post the reply's receive, then send ``msg``; returns the reply's future."""
        buf = proto.ctrl_buffer()
        reply = asyncio.ensure_future(self._recv_ctrl(buf, request_id))
        msg = dict(msg, req=request_id)
        await self.ep.send(proto.encode(msg),
                           tag=proto.make_tag(self.peer_id, 0xFFFFFF, proto.CTRL_PART),
                           force_tag=True)
        return reply

    async def _recv_ctrl(self, buf: np.ndarray, request_id: int) -> dict[str, Any]:
        await self.ep.recv(buf, tag=proto.make_tag(self.my_id, request_id, proto.CTRL_PART),
                           force_tag=True)
        return proto.decode(buf)

    async def next_reply(self, request_id: int) -> dict[str, Any]:
        return await self._recv_ctrl(proto.ctrl_buffer(), request_id)


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
        self._conns: dict[str, _Conn] = {}
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

    async def _conn(self, node: NodeInfo) -> _Conn:
        lock = self._conn_locks.setdefault(node.node_id, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node.node_id)
            if conn is not None and not conn.closed and conn.ucx_address == node.ucx_address:
                return conn
            if conn is not None:
                conn.abort()  # the node restarted (new address) or the connection failed
            ep = await endpoint_to(node.ucx_address)
            my_id = _next_conn_id()
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
            conn = _Conn(node.node_id, node.ucx_address, ep, my_id, int(msg["conn_id"]))
            self._conns[node.node_id] = conn
            conn.watcher = asyncio.ensure_future(self._watch(conn))
            return conn

    async def _watch(self, conn: _Conn) -> None:
        """Wait for the node's ``bye`` (request id 0) and drop the connection then: its
        pending requests fail at once instead of at their timeout."""
        try:
            msg = await conn.next_reply(0)
        except Exception:  # noqa: BLE001 - endpoint aborted: the connection is gone anyway
            return
        logger.info("store node %s closed our connection: %s", conn.node_id, msg.get("reason"))
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        self._nodes_cache = None
        conn.abort()
        if self._conns.get(conn.node_id) is conn:
            del self._conns[conn.node_id]

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
        raw, flat = await self._lookup(keys=[k.redis_key for k in keys], args=[NODE_PREFIX])
        entries = [IndexEntry.decode(r) for r in raw]
        nodes: dict[str, NodeInfo] = {}
        for j in range(0, len(flat), 6):
            nid, address, ucx_address, cap, used, slot = (
                x.decode() if isinstance(x, bytes) else str(x) for x in flat[j : j + 6])
            nodes[nid] = NodeInfo(nid, address, bytes.fromhex(ucx_address), int(cap), int(used),
                                  int(slot))
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
        return _leading(entries)

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
        request_id = _next_request_id()
        msg = {"op": "put", "keys": [k.redis_key for k in keys],
               "sizes": [v.nbytes for v in views],
               "checksums": [checksum(v) for v in views], "ttl_s": ttl_s, "runs": _runs(views)}

        async def run() -> dict[str, Any]:
            reply = await (await conn.request(request_id, msg))
            _raise_if_error(reply, node)
            done = asyncio.ensure_future(conn.next_reply(request_id))
            sends = [conn.ep.send(_span(views, i, n),
                                  tag=proto.make_tag(conn.peer_id, request_id, i),
                                  force_tag=True) for i, n in reply["msgs"]]
            await asyncio.gather(*sends)
            return await done

        try:
            final = await asyncio.wait_for(run(), self.timeout_s)
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
        n = _leading(entries)
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
        runs = _runs(mine)
        request = {"op": "get", "keys": [keys[i].redis_key for i in idx], "runs": runs}
        msgs = None
        if node.slot_bytes:
            slots: list[int | None] = [entries[i].slot for i in idx]  # type: ignore[union-attr]
            sizes = [entries[i].size_bytes for i in idx]  # type: ignore[union-attr]
            msgs = proto.group_messages(runs, slots, sizes, node.slot_bytes)
        for attempt in (0, 1):
            conn = await self._conn(node)
            request_id = _next_request_id()

            expect = msgs if attempt == 0 else None
            try:
                present = await asyncio.wait_for(
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

    async def _get_once(self, conn: _Conn, request_id: int, node: NodeInfo,
                        mine: list[np.ndarray], request: dict[str, Any],
                        expect: list[tuple[int, int]] | None) -> list[bool] | None:
        """One get request; ``None`` when the node answered ``stale``."""
        def post(cut: list[Any]) -> list[asyncio.Future[Any]]:
            return [asyncio.ensure_future(conn.ep.recv(
                _span(mine, j, n), tag=proto.make_tag(conn.my_id, request_id, j),
                force_tag=True)) for j, n in cut]

        recvs = post(expect) if expect is not None else []
        msg = dict(request, msgs=expect) if expect is not None else request
        reply = await (await conn.request(request_id, msg))
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
            return await (await conn.request(_next_request_id(), msg))

        try:
            reply = await asyncio.wait_for(run(), self.timeout_s)
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


def _leading(entries: Sequence[IndexEntry | None]) -> int:
    n = 0
    for e in entries:
        if e is None:
            break
        n += 1
    return n


def _raise_if_error(reply: dict[str, Any], node: NodeInfo) -> None:
    if reply.get("op") == "error":
        raise KVStoreNodeError(f"store node {node.node_id} ({node.address}): {reply['error']}")


class KVStoreClient:
    """Synchronous facade over :class:`AsyncKVStoreClient` for worker threads.

    Every method blocks the calling thread until done (each node request has
    ``timeout_s``); it may be called from several threads at once. Keys are
    :class:`BlockKey` in prefix order; blocks/``into`` are contiguous CPU
    buffers (e.g. ``kv_cache[b]``: ``[num_layers, 2, block_size, num_kv_heads,
    head_dim]`` in the model dtype), one per key.

    Args:
        redis_url: Redis of the store's index and node registry.
        layout: optional :class:`LayoutFingerprint`; keys and block sizes are then checked.
        local_node: ``host:port`` or node id of the node to put to first.
        timeout_s: deadline of each node request, seconds.
    """

    def __init__(self, redis_url: str, *, layout: LayoutFingerprint | None = None,
                 local_node: str | None = None, timeout_s: float = 10.0) -> None:
        self._loop = client_loop()
        self.timeout_s = timeout_s

        async def make() -> AsyncKVStoreClient:
            return AsyncKVStoreClient(redis_url, layout=layout, local_node=local_node,
                                      timeout_s=timeout_s)

        self.aio = self._loop.run(make(), timeout_s)

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
        return self._run(self.aio.get(keys, into))

    # -- compatibility with engine/kv_connector_store.py's BlockStoreClient protocol --------

    def put(self, keys: Sequence[BlockKey], values: Sequence[Any]) -> int:
        """Alias of :meth:`put_blocks`."""
        return self.put_blocks(keys, values)

    def get(self, keys: Sequence[BlockKey]) -> list[np.ndarray | None]:
        """Each leading block as a new uint8 array, ``None`` from the first miss on.

        NOTE: allocates; :meth:`get_blocks` writes into the cache directly.
        """
        async def run() -> list[np.ndarray | None]:
            k = self.aio._check_keys(keys)
            try:
                entries, _ = await self.aio._index(k)
            except (RedisError, OSError, KVStoreError):
                return [None] * len(k)
            n = _leading(entries)
            bufs = [np.empty(e.size_bytes, dtype=np.uint8) for e in entries[:n] if e]
            got = await self.aio.get(k[:n], bufs)
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
        self._run(self.aio.aclose())

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_sync(params: dict[str, Any]) -> KVStoreClient:
    """A :class:`KVStoreClient` from connector params: ``redis_url`` (required),
    ``kvstore_address`` (local node), ``kvstore_timeout_s`` (default 10).

    Raises:
        ValueError: no ``redis_url``.
    """
    url = params.get("redis_url")
    if not url:
        raise ValueError("params['redis_url'] is required")
    return KVStoreClient(url, local_node=params.get("kvstore_address"),
                         timeout_s=float(params.get("kvstore_timeout_s", 10.0)))


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
