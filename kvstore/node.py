"""A store node's state and request handlers (all on one asyncio loop).

See kvstore/protocol.py for the messages and kvstore/index.py for the Redis schema.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.contracts.block_key import INDEX_PREFIX, BlockKey
from tandem.kvstore import protocol as proto
from tandem.kvstore.config import NodeConfig
from tandem.kvstore.index import COMMIT_LUA, NODES_SET, IndexEntry, commit_args, node_key
from tandem.kvstore.metrics import NodeMetrics
from tandem.kvstore.pool import Entry, PoolFullError, SlotPool
from tandem.kvstore.shm import Segment, host_id
from tandem.kvstore.shm_ctl import CtlServer, ctl_address
from tandem.kvstore.ucx import endpoint_to, init_ucx, within, worker_address, worker_recv

logger = logging.getLogger("tandem.kvstore.server")


async def _raise(exc: BaseException) -> None:
    raise exc


class _Conn:
    """One client connection: our endpoint to it and the ids each side chose."""

    def __init__(self, conn_id: int, peer_conn_id: int, ep: Any) -> None:
        self.conn_id = conn_id
        self.peer_conn_id = peer_conn_id
        self.ep = ep
        self.closed = False

    async def reply(self, request_id: int, msg: dict[str, Any]) -> None:
        tag = proto.make_tag(self.peer_conn_id, request_id, proto.CTRL_PART)
        await self.ep.send(proto.encode(msg), tag=tag, force_tag=True)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.ep.abort()

    async def close_with_bye(self, reason: str) -> None:
        """Tell the client (best effort) that this connection is dropped, then abort it."""
        if self.closed:
            return
        try:
            await asyncio.wait_for(self.reply(0, {"op": "bye", "reason": reason}), 1.0)
        except Exception:  # noqa: BLE001 - client may be gone; abort regardless
            pass
        self.abort()


class StoreNode:
    """The node's state and request handlers; everything runs on one event loop."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.segment: Segment | None = None
        if cfg.shm:
            try:
                self.segment = Segment(cfg.node_id, cfg.capacity_bytes)
            except OSError as exc:
                logger.warning("no shared-memory pool (%s): same-host reads use UCX", exc)
        self.pool = SlotPool(cfg.capacity_bytes, cfg.slot_bytes, prefault=cfg.prefault,
                             buffer=self.segment.array if self.segment else None)
        # shared-memory reads in progress: (connection id, lease id) -> (blocks pinned,
        # expiry timer, start); only the connection that got a lease releases it
        self._leases: dict[tuple[int, int], tuple[list[Entry], asyncio.TimerHandle, float]] = {}
        self._next_lease = 1
        self.metrics = NodeMetrics()
        self.metrics.capacity_bytes.set(cfg.capacity_bytes)
        self.redis = aioredis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._commit = self.redis.register_script(COMMIT_LUA)
        self._next_conn = 1
        self._conns: dict[int, _Conn] = {}
        self._fp_sizes: dict[str, int] = {}  # layout fingerprint hex -> block bytes
        self._tasks: set[asyncio.Task[Any]] = set()
        self.redis_ok = False
        self.ucx_address = b""
        self.ctl: CtlServer | None = None  # same-host get_shm channel (kvstore/shm_ctl.py)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        init_ucx(self.cfg.ucx)
        self.ucx_address = worker_address()
        if self.segment is not None:
            ctl = CtlServer(self.pin_shm, self._release_lease, self._release_leases_of)
            try:
                await ctl.start(ctl_address(self.cfg.node_id, self.segment.ident))
                self.ctl = ctl
            except OSError as exc:
                logger.warning("no shared-memory control socket (%s): clients read over UCX",
                               exc)
        self._spawn(self._hello_loop())
        await self._heartbeat_once()
        self._spawn(self._heartbeat_loop())
        self._spawn(self._expiry_loop())
        logger.info("kvstore node %s on %s:%d: %d bytes, heartbeat TTL %.1fs",
                    self.cfg.node_id, self.cfg.host, self.cfg.port, self.cfg.capacity_bytes,
                    self.cfg.heartbeat_ttl_s)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("task failed: %r", task.exception(), exc_info=task.exception())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for c in self._conns.values():
            c.abort()
        if self.ctl is not None:
            await self.ctl.stop()
        # a clean stop withdraws the node and its index entries (a killed node's
        # entries are misses, removed by the clients that find them)
        gone = [(k, self._entry(self.pool.entries[k]).owner_prefix) for k in self.pool.lru_keys()]
        await self._try_commit(gone, [])
        try:
            await self.redis.delete(node_key(self.cfg.node_id))
        except (RedisError, OSError):
            pass
        await self.redis.aclose()
        if self.segment is not None:
            self.segment.close()

    # -- registry -----------------------------------------------------------------------------

    def _registry_fields(self) -> dict[Any, Any]:
        return {
            "address": f"{self.cfg.host}:{self.cfg.port}",
            "ucx_address": self.ucx_address.hex(),
            "capacity_bytes": self.cfg.capacity_bytes,
            "used_bytes": self.pool.used_bytes,
            "num_blocks": self.pool.num_blocks,
            "slot_bytes": self.pool.slot_bytes or 0,
            "hostname": socket.gethostname(),
            "host_id": host_id(),
            "shm_path": self.segment.path if self.segment else "",
            "shm_id": self.segment.ident if self.segment else "",
            "pid": os.getpid(),
            "updated_at": time.time(),
        }

    async def _heartbeat_once(self) -> None:
        key = node_key(self.cfg.node_id)
        fields = self._registry_fields()
        ttl_ms = int(self.cfg.heartbeat_ttl_s * 1000)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.exists(key)
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, ttl_ms)
                pipe.sadd(NODES_SET, self.cfg.node_id)
                existed, *_ = await pipe.execute()
        except (RedisError, OSError) as exc:
            if self.redis_ok:
                logger.warning("heartbeat failed (Redis unreachable?): %s", exc)
            self.redis_ok = False
            return
        if not existed and self.pool.num_blocks:
            # Registry entry was gone: Redis restarted (or we were partitioned long
            # enough to expire). Re-publish what this node holds.
            await self._republish()
        self.redis_ok = True

    async def _republish(self) -> None:
        new = []
        for key in self.pool.lru_keys():
            e = self.pool.entries[key]
            ttl_ms = self._ttl_ms(e)
            if ttl_ms is None:
                continue
            new.append((key, self._entry(e).encode(), ttl_ms))
        if new:
            keys, argv = commit_args([], new)
            await self._commit(keys=keys, args=argv)
            logger.info("re-published %d index entries after a registry loss", len(new))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ttl_s / 3)
            await self._heartbeat_once()
            self._update_gauges()

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.heartbeat_ttl_s / 3))
            gone = self.pool.expire()
            if gone:
                self.metrics.expirations.inc(len(gone))
                await self._try_commit([(e.key, self._entry(e).owner_prefix) for e in gone], [])
                self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.blocks_stored.set(self.pool.num_blocks)
        self.metrics.bytes_stored.set(self.pool.used_bytes)

    def _entry(self, e: Entry) -> IndexEntry:
        return IndexEntry(self.cfg.node_id, e.slot, e.size_bytes, e.checksum)

    @staticmethod
    def _ttl_ms(e: Entry) -> int | None:
        """Remaining TTL in ms (0: none); ``None`` if already expired."""
        if e.expires_at is None:
            return 0
        left = e.expires_at - time.monotonic()
        return int(left * 1000) if left > 0.001 else None

    async def _try_commit(self, evicted: list[tuple[str, str]],
                          new: list[tuple[str, str, int]]) -> bool:
        keys, argv = commit_args(evicted, new)
        if not keys:
            return True
        try:
            await self._commit(keys=keys, args=argv)
            return True
        except (RedisError, OSError) as exc:
            logger.warning("index update failed: %s", exc)
            self.metrics.errors.labels("index").inc()
            return False

    # -- connections --------------------------------------------------------------------------

    async def _hello_loop(self) -> None:
        while True:
            buf = proto.ctrl_buffer()
            await worker_recv(buf, proto.HELLO_TAG)
            try:
                msg = proto.decode(buf)
                address = bytes.fromhex(msg["address"])
                peer_conn = int(msg["conn_id"])
                ep = await endpoint_to(address)
            except Exception as exc:  # noqa: BLE001 - a bad hello must not stop the node
                logger.warning("bad HELLO: %s", exc)
                continue
            conn_id = self._next_conn
            self._next_conn = self._next_conn % 0xFFFE + 1
            conn = _Conn(conn_id, peer_conn, ep)
            self._conns[conn_id] = conn
            await conn.reply(0, {"op": "welcome", "conn_id": conn_id,
                                 "node_id": self.cfg.node_id})
            self._spawn(self._serve(conn))

    async def _serve(self, conn: _Conn) -> None:
        tag = proto.make_tag(conn.conn_id, 0xFFFFFF, proto.CTRL_PART)
        try:
            while not conn.closed:
                buf = proto.ctrl_buffer()
                await conn.ep.recv(buf, tag=tag, force_tag=True)
                try:
                    msg = proto.decode(buf)
                    request_id = int(msg["req"])
                except Exception as exc:  # noqa: BLE001 - malformed: drop the message
                    logger.warning("malformed request on connection %d: %s", conn.conn_id, exc)
                    continue
                work = None
                if msg.get("op") == "get":
                    # see _begin_get; a bad request is answered by _handle as usual
                    try:
                        work = self._begin_get(conn, request_id, msg)
                    except Exception as exc:  # noqa: BLE001 - re-raised in _handle
                        work = _raise(exc)
                self._spawn(self._handle(conn, request_id, msg, work))
        except Exception as exc:  # noqa: BLE001 - connection gone
            logger.info("connection %d closed: %s", conn.conn_id, exc)
        finally:
            conn.abort()
            self._conns.pop(conn.conn_id, None)

    async def _handle(self, conn: _Conn, request_id: int, msg: dict[str, Any],
                      work: Coroutine[Any, Any, None] | None = None) -> None:
        """Serve one request; ``work``: a get already begun by :meth:`_begin_get`."""
        op = msg.get("op")
        try:
            if work is not None:
                await work
            elif op == "put":
                await self._put(conn, request_id, msg)
            elif op == "stat":
                await conn.reply(request_id, self._stat())
            else:
                raise ValueError(f"unknown op {op!r}")
        except ValueError as exc:
            self.metrics.errors.labels("bad_request").inc()
            await self._reply_error(conn, request_id, str(exc))
        except (TimeoutError, asyncio.TimeoutError):
            self.metrics.errors.labels("timeout").inc()
            logger.warning("transfer on connection %d timed out; dropping it", conn.conn_id)
            await conn.close_with_bye("transfer timed out")
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the node
            self.metrics.errors.labels("internal").inc()
            logger.exception("request %s failed", op)
            await self._reply_error(conn, request_id, f"{type(exc).__name__}: {exc}")

    async def _reply_error(self, conn: _Conn, request_id: int, error: str) -> None:
        if conn.closed:
            return
        try:
            await asyncio.wait_for(conn.reply(request_id, {"op": "error", "error": error}),
                                   self.cfg.transfer_timeout_s)
        except Exception:  # noqa: BLE001 - client gone
            conn.abort()

    def _stat(self) -> dict[str, Any]:
        return {
            "op": "stat", "node_id": self.cfg.node_id, "lru": self.pool.lru_keys(),
            "num_blocks": self.pool.num_blocks, "used_bytes": self.pool.used_bytes,
            "slot_bytes": self.pool.slot_bytes, "num_slots": self.pool.num_slots,
            "num_evictions": self.pool.num_evictions,
            "pinned": sorted(k for k, e in self.pool.entries.items() if e.pins),
        }

    # -- put / get ----------------------------------------------------------------------------

    def _validate_put(self, msg: dict[str, Any]) -> tuple[list[str], list[int], list[str]]:
        keys, sizes, sums = msg.get("keys"), msg.get("sizes"), msg.get("checksums")
        if not (isinstance(keys, list) and isinstance(sizes, list) and isinstance(sums, list)):
            raise ValueError("put needs lists keys, sizes and checksums")
        if not len(keys) == len(sizes) == len(sums):
            raise ValueError("keys, sizes and checksums must have the same length")
        if len(keys) > proto.MAX_BLOCKS_PER_REQUEST:
            raise ValueError(f"at most {proto.MAX_BLOCKS_PER_REQUEST} blocks per request")
        total = 0
        for i, (k, n) in enumerate(zip(keys, sizes, strict=True)):
            if not isinstance(k, str) or not k.startswith(INDEX_PREFIX):
                raise ValueError(f"keys[{i}] is not a block index key")
            fp = str(BlockKey.from_str(k[len(INDEX_PREFIX):]).layout_fingerprint.hex())
            if not isinstance(n, int):
                raise ValueError(f"sizes[{i}] must be an int")
            self.pool.check_size(n)
            known = self._fp_sizes.get(fp)
            if known is not None and known != n:
                raise ValueError(
                    f"sizes[{i}]={n} bytes but layout {fp} has {known}-byte blocks "
                    "(wrong block size)"
                )
            total += n
        if total > self.cfg.capacity_bytes:
            raise ValueError(
                f"put of {total} bytes is larger than the node capacity "
                f"{self.cfg.capacity_bytes} bytes"
            )
        slot = self.pool.slot_bytes or (sizes[0] if sizes else 1)
        if len(keys) > self.cfg.capacity_bytes // slot:
            raise ValueError(
                f"put of {len(keys)} blocks is larger than the node capacity "
                f"({self.cfg.capacity_bytes // slot} slots)"
            )
        return keys, sizes, [str(s) for s in sums]

    async def _put(self, conn: _Conn, request_id: int, msg: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        keys, sizes, sums = self._validate_put(msg)
        runs = msg.get("runs") or [[i, 1] for i in range(len(keys))]
        proto.group_messages(runs, [None] * len(keys), sizes, 1)  # validates the runs
        ttl_s = msg.get("ttl_s") or self.cfg.block_ttl_s
        if ttl_s is not None and (not isinstance(ttl_s, int | float) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        formatted = self.pool.slot_bytes is not None
        accepted: list[int] = []
        pending: list[Entry] = []
        evicted: list[Entry] = []
        try:
            for i, (k, n, s) in enumerate(zip(keys, sizes, sums, strict=True)):
                have = self.pool.entries.get(k)
                if have is not None and (have.checksum == s or have.pins):
                    # already here (its index entry is rewritten below), being written
                    # by a concurrent put of the same prefix, or being read: keep it
                    continue
                entry, gone = self.pool.allocate(k, n, s, ttl_s)
                pending.append(entry)
                evicted += gone
                accepted.append(i)
        except (PoolFullError, ValueError) as exc:
            for e in pending:
                self.pool.abort(e)
            await self._try_commit([(e.key, self._entry(e).owner_prefix) for e in evicted], [])
            raise ValueError(str(exc)) from exc
        for k, n in zip(keys, sizes, strict=True):
            self._fp_sizes.setdefault(k[len(INDEX_PREFIX):].partition(":")[0], n)
        if not formatted:
            # the slot size was just fixed: publish it now (clients use it to post
            # get receives before their request)
            self._spawn(self._heartbeat_once())
        self.metrics.evictions.inc(len(evicted))
        ok = False
        try:
            by_index = dict(zip(accepted, pending, strict=True))
            slots = [by_index[i].slot if i in by_index else None for i in range(len(keys))]
            msgs = proto.group_messages(runs, slots, sizes, self.pool.slot_bytes or 1)
            # the receives are posted before the accept goes out (gather starts them
            # in order), and the accept's completion is not waited for first
            recvs = [
                conn.ep.recv(self.pool.span(by_index[i].slot, n, by_index[i + n - 1].size_bytes),
                             tag=proto.make_tag(conn.conn_id, request_id, i), force_tag=True)
                for i, n in msgs
            ]
            await within(
                asyncio.gather(*recvs, conn.reply(request_id, {"op": "accept", "msgs": msgs})),
                self.cfg.transfer_timeout_s)
            ok = True
        finally:
            if not ok:
                conn.abort()  # cancels the posted receives before the slots are reused
                for e in pending:
                    self.pool.abort(e)
                await self._try_commit(
                    [(e.key, self._entry(e).owner_prefix) for e in evicted], [])
        new = []
        mine = {id(e) for e in pending}
        for k in keys:
            found = self.pool.entries.get(k)
            if found is None or (not found.committed and id(found) not in mine):
                continue  # another put's pending write commits it
            ttl_ms = self._ttl_ms(found)
            if ttl_ms is not None:
                new.append((k, self._entry(found).encode(), ttl_ms))
        # NOTE: readable here before the index commit: a get that finds a fresh index
        # entry while the commit's reply is on its way must find the bytes too, or it
        # removes the entry as one whose payload is gone. Nobody finds them through
        # the index before the commit lands; if it fails they stay unindexed (evicted
        # in LRU order; a later put of the same key indexes them again).
        for e in pending:
            self.pool.commit(e)
        committed = await self._try_commit(
            [(e.key, self._entry(e).owner_prefix) for e in evicted], new)
        if not committed:
            raise RuntimeError("index (Redis) unreachable: blocks not stored")
        self.metrics.put_bytes.inc(sum(e.size_bytes for e in pending))
        self.metrics.put_latency.observe(time.perf_counter() - t0)
        self._update_gauges()
        await conn.reply(request_id, {"op": "stored", "num_stored": len(new),
                                      "num_sent": len(pending)})

    def _begin_get(self, conn: _Conn, request_id: int,
                   msg: dict[str, Any]) -> Coroutine[Any, Any, None]:
        """Pin the blocks of a get and start its reply and payload sends, without
        yielding to the loop; returns the coroutine that waits for the sends.

        NOTE: called by the connection's receive loop itself, not in a task of its
        own: the sends are posted one loop iteration sooner, and each iteration on
        the hot path costs a GIL hand-off with ucxx's notifier thread.

        Raises:
            ValueError: malformed request (nothing pinned, nothing sent).
        """
        t0 = time.perf_counter()
        keys = msg.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("get needs a list of key strings")
        if len(keys) > proto.MAX_BLOCKS_PER_REQUEST:
            raise ValueError(f"at most {proto.MAX_BLOCKS_PER_REQUEST} blocks per request")
        runs = msg.get("runs") or [[i, 1] for i in range(len(keys))]
        proto.group_messages(runs, [None] * len(keys), [0] * len(keys), 1)  # validates the runs
        entries = [self.pool.acquire(k) for k in keys]
        held = [e for e in entries if e is not None]
        try:
            self.metrics.hits.inc(len(held))
            self.metrics.misses.inc(len(keys) - len(held))
            sizes = [e.size_bytes if e else 0 for e in entries]
            msgs = proto.group_messages(runs, [e.slot if e else None for e in entries], sizes,
                                        self.pool.slot_bytes or 1)
            expect = msg.get("msgs")
            if expect is not None and (len(held) < len(keys)
                                       or [list(m) for m in msgs] != expect):
                # the client posted receives for another cut: send nothing
                msgs = []
                reply = {"op": "present", "stale": True,
                         "present": [e is not None for e in entries]}
            else:
                reply = {"op": "present", "present": [e is not None for e in entries],
                         "sizes": sizes, "msgs": msgs}
            # NOTE: the payload goes out together with the reply, not after its
            # completion: tags keep them apart, and waiting would add a UCX-to-loop
            # hand-off to every get's latency
            sends = asyncio.gather(conn.reply(request_id, reply), *(
                conn.ep.send(self.pool.span(entries[i].slot, n,  # type: ignore[union-attr]
                                            entries[i + n - 1].size_bytes),  # type: ignore[union-attr]
                             tag=proto.make_tag(conn.peer_conn_id, request_id, i),
                             force_tag=True)
                for i, n in msgs))
        except BaseException:
            for e in held:
                self.pool.release(e)
            raise
        return self._end_get(conn, sends, held, t0)

    async def _end_get(self, conn: _Conn, sends: asyncio.Future[Any], held: list[Entry],
                       t0: float) -> None:
        """Wait for a get's sends (see :meth:`_begin_get`), then unpin its blocks."""
        try:
            # on failure, cancel the sends before the slots can be evicted
            await self._send_or_undo(sends, conn.abort)
        finally:
            for e in held:
                self.pool.release(e)
        self.metrics.get_bytes.inc(sum(e.size_bytes for e in held))
        self.metrics.get_latency.observe(time.perf_counter() - t0)

    # -- shared-memory get (served on the control socket, kvstore/shm_ctl.py) ------------------

    def pin_shm(self, conn_id: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Pin the blocks a ``get_shm`` request names; returns the ``shm`` reply with
        their offsets in the shared segment (kvstore/protocol.py).

        The blocks stay pinned (not evicted, not overwritten) until connection
        ``conn_id`` releases the lease, closes, or :attr:`NodeConfig.shm_lease_s`
        passes.

        Raises:
            ValueError: malformed request, or this node has no shared segment.
        """
        t0 = time.perf_counter()
        if self.segment is None:
            raise ValueError("this node's pool is not in shared memory (started with --no-shm)")
        keys = msg.get("keys")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("get_shm needs a list of key strings")
        if len(keys) > proto.MAX_BLOCKS_PER_REQUEST:
            raise ValueError(f"at most {proto.MAX_BLOCKS_PER_REQUEST} blocks per request")
        entries = [self.pool.acquire(k) for k in keys]
        held = [e for e in entries if e is not None]
        self.metrics.hits.inc(len(held))
        self.metrics.misses.inc(len(keys) - len(held))
        lease = 0
        if held:
            lease = self._next_lease
            self._next_lease += 1
            timer = asyncio.get_running_loop().call_later(
                self.cfg.shm_lease_s, self._expire_lease, conn_id, lease)
            self._leases[conn_id, lease] = (held, timer, t0)
        return {"op": "shm", "lease": lease,
                "offsets": [self.pool.offset(e.slot) if e else -1 for e in entries],
                "sizes": [e.size_bytes if e else 0 for e in entries]}

    async def _send_or_undo(self, send: Awaitable[Any], undo: Callable[[], None]) -> None:
        """Await a reply or payload send within the transfer timeout; if it fails (or
        is cancelled), run ``undo`` before the error propagates."""
        try:
            await within(send, self.cfg.transfer_timeout_s)
        except BaseException:
            undo()
            raise

    def _release_lease(self, conn_id: int, lease: Any, expired: bool = False) -> None:
        """Unpin a shared-memory read's blocks (unknown or released leases: no-op)."""
        if not isinstance(lease, int):
            return
        held = self._leases.pop((conn_id, lease), None)
        if held is None:
            return
        entries, timer, t0 = held
        timer.cancel()
        for e in entries:
            self.pool.release(e)
        if expired:
            return
        self.metrics.get_bytes.inc(sum(e.size_bytes for e in entries))
        self.metrics.get_latency.observe(time.perf_counter() - t0)

    def _release_leases_of(self, conn_id: int) -> None:
        """Unpin every lease a closed connection still holds."""
        for cid, lease in [k for k in self._leases if k[0] == conn_id]:
            self._release_lease(cid, lease, expired=True)

    def _expire_lease(self, conn_id: int, lease: int) -> None:
        if (conn_id, lease) in self._leases:
            logger.warning("shared-memory read lease %d of connection %d not released "
                           "within %.1fs: unpinned", lease, conn_id, self.cfg.shm_lease_s)
            self.metrics.errors.labels("lease_expired").inc()
            self._release_lease(conn_id, lease, expired=True)
