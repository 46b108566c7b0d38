"""Same-host gets on the caller's thread: Redis lookup, pin, copy, release.

Why: a get on :class:`~tandem.kvstore.aio_client.AsyncKVStoreClient` hops from
the caller's thread to the client loop and back, and its ``get_shm`` crosses
UCX's progress and notifier threads on both sides; on the 2-core dev box that
was ~2.5 ms of a 16 MiB get before a byte moved. When the blocks sit on a node
of this host, :class:`SameHostReader` does the whole get on the calling thread:

1. ``get_shm`` for every key to the node the previous same-host get read
   (kvstore/shm_ctl.py), sent first so that the node pins while Redis answers;
2. the index lookup (:data:`~tandem.kvstore.index.LOOKUP_LUA`, a blocking
   redis-py client);
3. the node's reply, if the index places the leading blocks on that node (else
   one ``get_shm`` to the node it names, when that node is on this host);
4. copy and checksum (``AsyncKVStoreClient._copy_shm``), then ``release``.

Anything else (blocks on several nodes or another host, a dead node's entries,
a block the node no longer has, an unreachable index or channel) goes to the
client loop's path, with the index entries already read where they can be
reused. Semantics are those of ``get`` (kvstore/store.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import redis
from redis.exceptions import RedisError

from tandem.kvstore.aio_client import AsyncKVStoreClient, leading_count
from tandem.kvstore.index import LOOKUP_LUA, NODE_PREFIX, IndexEntry, parse_lookup
from tandem.kvstore.keys import BlockKey
from tandem.kvstore.shm import Mapping
from tandem.kvstore.shm_ctl import CtlChannel, ctl_address
from tandem.kvstore.transport import NodeInfo

logger = logging.getLogger("tandem.kvstore.client")


class SameHostReader:
    """Gets from a node of this host, done on the calling thread.

    Args:
        aio: the client whose validation, mappings, copy and counters are shared.
        redis_url: the index's Redis.
        timeout_s: deadline of the lookup and of each channel send/receive, seconds.
        run: runs a coroutine of ``aio`` on its loop and returns the result (the
            fallback path).

    Thread-safe: each thread has its own channel to each node.
    """

    def __init__(self, aio: AsyncKVStoreClient, redis_url: str, timeout_s: float,
                 run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self.aio = aio
        self.timeout_s = timeout_s
        self._run = run
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                          socket_connect_timeout=timeout_s)
        self._lookup = self.redis.register_script(LOOKUP_LUA)
        self._local = threading.local()
        #: gets served entirely on the calling thread
        self.num_gets = 0
        #: of those, served by the pins requested before the index lookup
        self.num_speculative_gets = 0

    # -- channels ---------------------------------------------------------------------------

    def _channel(self, node: NodeInfo) -> CtlChannel | None:
        """This thread's channel to ``node`` (``None``: cannot connect)."""
        chans: dict[str, CtlChannel] = self._local.__dict__.setdefault("chans", {})
        address = ctl_address(node.node_id, node.shm_id)
        ch = chans.get(node.node_id)
        if ch is not None and ch.address == address:
            return ch
        if ch is not None:
            ch.close()  # the node restarted with another segment
            del chans[node.node_id]
        try:
            ch = CtlChannel(address, self.timeout_s)
        except OSError as exc:
            logger.debug("no shared-memory channel to %s: %s", node.node_id, exc)
            return None
        chans[node.node_id] = ch
        return ch

    def _drop(self, node_id: str) -> None:
        ch = self._local.__dict__.get("chans", {}).pop(node_id, None)
        if ch is not None:
            ch.close()  # the node releases the connection's leases

    def close(self) -> None:
        """Close this thread's channels and the Redis connections (other threads'
        channels close with their threads)."""
        for node_id in list(self._local.__dict__.get("chans", {})):
            self._drop(node_id)
        self.redis.close()

    # -- get ----------------------------------------------------------------------------------

    def _usable(self, node: NodeInfo | None) -> Mapping | None:
        """``node``'s mapped segment when a same-host read of it can be tried."""
        if node is None or not node.shm_id:
            return None
        return self.aio._mapping(node)

    def get(self, keys: Sequence[BlockKey], into: Sequence[Any]) -> int:
        """``BlockStore.get`` (kvstore/store.py): load the leading present blocks of
        ``keys`` into ``into`` (one contiguous CPU buffer per key); returns how many.

        Raises:
            ValueError: bad keys or buffers (as ``get``).
            KVStoreError / KVStoreTimeoutError: from the fallback path.
        """
        aio = self.aio
        aio._check_open()
        keys = aio._check_keys(keys)
        views = aio._views(into, len(keys), writable=True, name="into")
        if not keys:
            return 0
        names = [k.redis_key for k in keys]
        # 1. speculative pin on the node of the previous same-host get
        spec_node = aio._shm_node if aio.shm else None
        spec: tuple[NodeInfo, CtlChannel, int] | None = None
        if self._usable(spec_node) is not None:
            assert spec_node is not None
            ch = self._channel(spec_node)
            if ch is not None:
                try:
                    spec = (spec_node, ch, ch.send_get(names))
                except OSError:
                    self._drop(spec_node.node_id)
        try:
            # 2. the index
            try:
                entries, records = parse_lookup(
                    len(keys), self._lookup(keys=names, args=[NODE_PREFIX]))
                nodes = {r[0]: NodeInfo.from_lookup(r) for r in records}
            except (RedisError, OSError, ValueError):
                return self._fallback(spec, lambda: aio.get(keys, into))
            if any(e is not None and e.node_id not in nodes for e in entries):
                # a dead node's entries: the loop's path turns them into misses and
                # cleans them up
                return self._fallback(spec, lambda: aio.get(keys, into))
            n = leading_count(entries)
            owners = {e.node_id for e in entries[:n] if e is not None}
            node = nodes[owners.pop()] if len(owners) == 1 else None
            mapping = self._usable(node) if aio.shm else None
            if node is None or mapping is None:
                return self._fallback(spec, lambda: aio._get_indexed(keys, views, entries, nodes))
            for i in range(n):
                e = entries[i]
                assert e is not None
                if e.size_bytes != views[i].nbytes:
                    self._fallback(spec, None)
                    spec = None
                    raise ValueError(f"into[{i}] has {views[i].nbytes} bytes, the stored block "
                                     f"has {e.size_bytes}")
            # 3. the pins: the speculative request's, or one sent now
            if spec is not None and (spec[0].node_id, spec[0].shm_id) == (node.node_id,
                                                                        node.shm_id):
                ch, req = spec[1], spec[2]
                spec = None
                self.num_speculative_gets += 1
            else:
                self._fallback(spec, None)
                spec = None
                got = self._channel(node)
                if got is None:
                    return self._run(aio._get_indexed(keys, views, entries, nodes))
                ch = got
                try:
                    req = ch.send_get(names[:n])
                except OSError:
                    self._drop(node.node_id)
                    return self._run(aio._get_indexed(keys, views, entries, nodes))
            try:
                reply = ch.recv_reply(req)
            except (OSError, ValueError):
                self._drop(node.node_id)  # closing it releases whatever it pinned
                return self._run(aio._get_indexed(keys, views, entries, nodes))
            return self._copy(node, ch, mapping, reply, keys, views, entries, nodes, n)
        finally:
            if spec is not None:
                self._fallback(spec, None)

    def _copy(self, node: NodeInfo, ch: CtlChannel, mapping: Mapping, reply: dict[str, Any],
              keys: list[BlockKey], views: list[np.ndarray],
              entries: list[IndexEntry | None], nodes: dict[str, NodeInfo], n: int) -> int:
        """4. copy the pinned blocks, release them, count the intact leading ones."""
        aio = self.aio
        lease = reply.get("lease")
        offsets, sizes = reply.get("offsets"), reply.get("sizes")
        loaded: dict[int, bool | None] = {}
        try:
            if (reply.get("op") == "shm" and isinstance(offsets, list)
                    and isinstance(sizes, list) and len(offsets) >= n and len(sizes) >= n):
                loaded = aio._copy_shm(mapping, offsets[:n], sizes[:n], list(range(n)),
                                       views[:n], entries)
        finally:
            if isinstance(lease, int) and lease:
                try:
                    ch.release(lease)
                except OSError:
                    self._drop(node.node_id)
        if len(loaded) < n:
            # an error reply, or a block the index names but the node no longer
            # has: the loop's path tells which, and cleans up
            return self._run(aio._get_indexed(keys, views, entries, nodes))
        count, bad = aio.count_loaded(keys, views, entries, n, loaded)
        if bad is not None:
            self._run(aio._forget(keys[bad], entries[bad]))  # type: ignore[arg-type]
        aio.num_shm_gets += 1
        aio._shm_node = node
        self.num_gets += 1
        return count

    def _fallback(self, spec: tuple[NodeInfo, CtlChannel, int] | None,
                  then: Callable[[], Coroutine[Any, Any, int]] | None) -> int:
        """Release the speculative pins (if any), then run ``then`` on the client loop."""
        if spec is not None:
            node, ch, req = spec
            try:
                lease = ch.recv_reply(req).get("lease")
                if isinstance(lease, int) and lease:
                    ch.release(lease)
            except (OSError, ValueError):
                self._drop(node.node_id)
        return self._run(then()) if then is not None else 0
