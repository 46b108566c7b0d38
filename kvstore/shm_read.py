"""Same-host gets on the caller's thread: Redis lookup, pin, copy, release.

Why: a get on :class:`~tandem.kvstore.aio_client.AsyncKVStoreClient` hops from
the caller's thread to the client loop and back, and its ``get_shm`` crosses
UCX's progress and notifier threads on both sides; on the 2-core dev box that
was ~2.5 ms of a 16 MiB get before a byte moved. When the blocks sit on a node
of this host, :class:`SameHostReader` does the whole get on the calling thread:

1. ``get_shm`` for every key to the node the previous same-host get read
   (kvstore/shm_ctl.py), sent first so that the node pins while Redis answers;
2. the index lookup (:data:`~tandem.kvstore.index.LOOKUP_LUA`) sent on a
   blocking redis-py connection, its reply read only after
3. the pinned leading blocks are copied into the caller's buffers and
   checksummed (``AsyncKVStoreClient._copy_shm``) and released: the copy
   overlaps the Redis round trip;
4. the index decides: blocks count only where it places them on that node with
   that checksum (else one ``get_shm`` to the node it names, if on this host).

Anything else (blocks on several nodes or another host, a dead node's entries,
a block the node no longer has, an unreachable index or channel) goes to the
client loop's path, with the index entries already read where they can be
reused. Semantics are those of ``get`` (kvstore/store.py).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import redis
from redis.exceptions import NoScriptError, RedisError

from tandem.contracts.block_key import BlockKey
from tandem.kvstore.aio_client import AsyncKVStoreClient, leading_by_node, verdicts
from tandem.kvstore.index import LOOKUP_LUA, NODE_PREFIX, IndexEntry, parse_lookup
from tandem.kvstore.shm import Mapping
from tandem.kvstore.shm_ctl import CtlChannel, ctl_address
from tandem.kvstore.store import KVStoreError, KVStoreTimeoutError
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
        # every live thread's channels, closed by close(); weak, so that a channel of
        # a thread that has exited is collected (and its socket closed) with it
        self._all: weakref.WeakSet[CtlChannel] = weakref.WeakSet()
        self._all_lock = threading.Lock()
        #: gets served entirely on the calling thread
        self.num_gets = 0
        #: of those, served by the pins requested before the index lookup
        self.num_speculative_gets = 0

    # -- channels ---------------------------------------------------------------------------

    def _channel(self, node: NodeInfo) -> CtlChannel | None:
        """This thread's channel to ``node`` (``None``: cannot connect, or closed)."""
        if self.aio._closed:
            return None
        chans: dict[str, CtlChannel] = self._local.__dict__.setdefault("chans", {})
        address = ctl_address(node.node_id, node.shm_id)
        ch = chans.get(node.node_id)
        if ch is not None and ch.address == address:
            return ch
        if ch is not None:
            self._drop(node.node_id)  # the node restarted with another segment
        try:
            ch = CtlChannel(address, self.timeout_s)
        except OSError as exc:
            logger.debug("no shared-memory channel to %s: %s", node.node_id, exc)
            return None
        with self._all_lock:
            if self.aio._closed:
                ch.close()
                return None
            self._all.add(ch)
        chans[node.node_id] = ch
        return ch

    def _fail(self, node: NodeInfo, exc: BaseException) -> None:
        """A channel to ``node`` failed (``exc``): close it, which releases whatever it
        pinned, and stop speculating on that node.

        Raises:
            KVStoreTimeoutError: ``exc`` is a timeout (the node is hung).
        """
        self._drop(node.node_id)
        shm_node = self.aio._shm_node
        if shm_node is not None and shm_node.node_id == node.node_id:
            self.aio._shm_node = None
        if isinstance(exc, TimeoutError):
            raise self._timeout(node) from exc

    def _timeout(self, node: NodeInfo) -> KVStoreTimeoutError:
        return KVStoreTimeoutError(
            f"get from store node {node.node_id} ({node.address}) timed out after "
            f"{self.timeout_s}s (node hung or overloaded)")

    def _drop(self, node_id: str) -> None:
        ch = self._local.__dict__.get("chans", {}).pop(node_id, None)
        if ch is not None:
            with self._all_lock:
                self._all.discard(ch)
            ch.close()  # the node releases the connection's leases

    def close(self) -> None:
        """Close every thread's channels and the Redis connections."""
        with self._all_lock:
            chans, self._all = list(self._all), weakref.WeakSet()
        for ch in chans:
            ch.close()
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
        The index unreachable: a miss (0), as on the client loop's path.

        Raises:
            ValueError: bad keys or buffers (as ``get``).
            KVStoreTimeoutError: a node holding a leading block did not answer.
            KVStoreError: the client was closed, or from the fallback path.
        """
        try:
            return self._get(keys, into)
        except (ValueError, KVStoreError):
            raise
        except Exception as exc:
            if self.aio._closed:  # close() pulled connections and pools from under us
                raise KVStoreError("client is closed") from exc
            raise

    def _get(self, keys: Sequence[BlockKey], into: Sequence[Any]) -> int:
        aio = self.aio
        aio._check_open()
        keys = aio._check_keys(keys)
        views = aio._views(into, len(keys), writable=True, name="into")
        if not keys:
            return 0
        names = [k.redis_key for k in keys]
        # 1. pins on the node of the previous same-host get, requested first
        spec = self._send_spec(names)
        early: tuple[NodeInfo, dict[int, str] | None] | None = None
        try:
            # 2. the index lookup goes out; while Redis answers, 3. the speculative
            # blocks are copied (the index then says whether they count)
            lookup = _PendingLookup(self, names)
            try:
                if spec is not None:
                    taken, spec = spec, None
                    early = self._copy_spec(taken, views)
                entries, nodes = lookup.result()
            finally:
                lookup.close()
        except KVStoreError:
            raise
        except (RedisError, OSError) as exc:
            logger.warning("get: index unreachable, reporting a miss: %s", exc)
            return 0
        except ValueError as exc:
            raise KVStoreError(f"KV store index (Redis) answered a malformed lookup: {exc}") \
                from exc
        finally:
            self._settle(spec)
        if any(e is not None and e.node_id not in nodes for e in entries):
            # a dead node's entries: the loop's path turns them into misses and
            # cleans them up
            return self._run(aio.get(keys, into))
        n, by_node = leading_by_node(entries, views)
        if n == 0:
            return 0
        node = nodes[next(iter(by_node))] if len(by_node) == 1 else None
        if node is None:
            return self._run(aio._get_indexed(keys, views, entries, nodes))
        same = early is not None and (early[0].node_id, early[0].shm_id) == (node.node_id,
                                                                             node.shm_id)
        if same and early is not None and early[1] is None:
            raise self._timeout(node)
        if same and early is not None and early[1] is not None and \
                all(i in early[1] for i in range(n)):
            self.num_speculative_gets += 1
            sums = early[1]
        else:
            got = self._pin_and_copy(node, names[:n], views[:n])
            if got is None:
                return self._run(aio._get_indexed(keys, views, entries, nodes))
            sums = got
            # indexed but not on its node (evicted or lost since): a miss, cleaned up
            gone = [(keys[i].redis_key, entries[i]) for i in range(n) if i not in sums]
            if gone:
                self._run(aio._forget_many(gone))  # type: ignore[arg-type]
        # (the speculative copy may hold blocks past the leading ones: not counted)
        leading = {i: sums[i] for i in range(n) if i in sums}
        count, bad = aio.count_loaded(keys, views, entries, n, verdicts(leading, entries))
        if bad is not None:
            self._run(aio._forget(keys[bad], entries[bad]))  # type: ignore[arg-type]
        aio.num_shm_gets += 1
        aio._shm_node = node
        self.num_gets += 1
        return count

    def _send_spec(self, names: list[str]) -> tuple[NodeInfo, Mapping, CtlChannel, int] | None:
        """``get_shm`` of ``names`` to the node of the previous same-host get."""
        node = self.aio._shm_node if self.aio.shm else None
        mapping = self._usable(node)
        if node is None or mapping is None:
            return None
        ch = self._channel(node)
        if ch is None:
            return None
        try:
            return node, mapping, ch, ch.send_get(names)
        except ValueError:
            return None  # too many keys for one control message: nothing was sent
        except OSError:
            self._drop(node.node_id)
            return None

    def _copy_spec(self, spec: tuple[NodeInfo, Mapping, CtlChannel, int],
                   views: list[np.ndarray]) -> tuple[NodeInfo, dict[int, str] | None] | None:
        """Copy the blocks the speculative reply pinned, then release them;
        returns the node and each copied block's checksum (``None``: the node timed
        out; ``None`` instead of the pair: no usable reply)."""
        node, mapping, ch, req = spec
        try:
            reply = ch.recv_reply(req)
        except (OSError, ValueError) as exc:
            try:
                self._fail(node, exc)
            except KVStoreTimeoutError:
                return node, None  # hung: an error only if it holds the blocks we need
            return None
        return node, self._copy_reply(node, ch, mapping, reply, views)

    def _pin_and_copy(self, node: NodeInfo, names: list[str],
                      views: list[np.ndarray]) -> dict[int, str] | None:
        """Pin ``names`` on ``node``, copy them, release; ``None`` when the node is not
        reachable this way."""
        mapping = self._usable(node) if self.aio.shm else None
        ch = self._channel(node) if mapping is not None else None
        if mapping is None or ch is None:
            return None
        try:
            req = ch.send_get(names)
        except ValueError:
            return None  # too many keys for one control message: nothing was sent
        except OSError as exc:
            self._fail(node, exc)
            return None
        try:
            reply = ch.recv_reply(req)
        except (OSError, ValueError) as exc:
            self._fail(node, exc)
            return None
        return self._copy_reply(node, ch, mapping, reply, views)

    def _copy_reply(self, node: NodeInfo, ch: CtlChannel, mapping: Mapping,
                    reply: dict[str, Any], views: list[np.ndarray]) -> dict[int, str]:
        """Copy the blocks a ``get_shm`` reply pinned (offset -1: absent, skipped), then
        release the lease; returns each copied block's checksum."""
        lease = reply.get("lease")
        offsets, sizes = reply.get("offsets"), reply.get("sizes")
        try:
            if reply.get("op") != "shm" or not isinstance(offsets, list) \
                    or not isinstance(sizes, list):
                return {}
            m = min(len(offsets), len(sizes), len(views))
            return self.aio._copy_shm(mapping, offsets[:m], sizes[:m], list(range(m)), views[:m])
        finally:
            if isinstance(lease, int) and lease:
                try:
                    ch.release(lease)
                except OSError:
                    self._drop(node.node_id)

    def _settle(self, spec: tuple[NodeInfo, Mapping, CtlChannel, int] | None) -> None:
        """Release an unused speculative request's pins."""
        if spec is None:
            return
        node, _, ch, req = spec
        try:
            lease = ch.recv_reply(req).get("lease")
            if isinstance(lease, int) and lease:
                ch.release(lease)
        except (OSError, ValueError) as exc:
            try:
                self._fail(node, exc)
            except KVStoreTimeoutError:
                pass  # its blocks were not needed


class _PendingLookup:
    """:data:`LOOKUP_LUA` sent on a connection of ``reader``'s pool, its reply read
    later (:meth:`result`), so that work overlaps the round trip.

    Raises:
        RedisError / OSError: the command could not be sent.
    """

    def __init__(self, reader: SameHostReader, names: list[str]) -> None:
        self.reader = reader
        self.names = names
        self.pool = reader.redis.connection_pool
        self.conn: Any = self.pool.get_connection()
        self.pending = False
        try:
            self.conn.send_command("EVALSHA", reader._lookup.sha, len(names), *names,
                                   NODE_PREFIX)
            self.pending = True
        except BaseException:
            self.close()
            raise

    def result(self) -> tuple[list[IndexEntry | None], dict[str, NodeInfo]]:
        """Entries (``None``: absent) and the live nodes they name.

        Raises:
            RedisError / OSError: Redis failed; ValueError: malformed reply.
        """
        try:
            reply = self.conn.read_response()
            self.pending = False
        except NoScriptError:
            self.pending = False
            # first use on this Redis (or it restarted): the script loads itself
            reply = self.reader._lookup(keys=self.names, args=[NODE_PREFIX])
        entries, records = parse_lookup(len(self.names), reply)
        return entries, {r[0]: NodeInfo.from_lookup(r) for r in records}

    def close(self) -> None:
        """Give the connection back (dropped if its reply was never read)."""
        if self.conn is None:
            return
        if self.pending:
            self.conn.disconnect()
        self.pool.release(self.conn)
        self.conn = None
