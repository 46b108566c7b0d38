"""A store node's state and request handlers (all on one asyncio loop).

See kvstore/protocol.py for the messages and kvstore/index.py for the Redis schema.
Parts: this module holds the node's lifecycle, client connections and put/get over UCX;
kvstore/node_index.py its registry entry and index commits in Redis (the heartbeat);
kvstore/node_leases.py the leases of same-host shared-memory reads; kvstore/node_disk.py
the disk tier (blocks evicted from RAM, read back on a get).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from tandem.contracts.block_key import INDEX_PREFIX, BlockKey
from tandem.contracts.tracing import TRACING_OFF, Tracing
from tandem.kvstore import protocol as proto
from tandem.kvstore.config import NodeConfig
from tandem.kvstore.metrics import NodeMetrics
from tandem.kvstore.node_conn import Conn
from tandem.kvstore.node_disk import NodeDisk
from tandem.kvstore.node_index import NodeIndex
from tandem.kvstore.node_leases import ShmLeases
from tandem.kvstore.node_spans import request_span
from tandem.kvstore.pool import Entry, PoolFullError, SlotPool
from tandem.kvstore.shm import Segment
from tandem.kvstore.shm_ctl import CtlServer, ctl_address
from tandem.kvstore.ucx import endpoint_to, init_ucx, within, worker_address, worker_recv

logger = logging.getLogger("tandem.kvstore.server")


async def _raise(exc: BaseException) -> None:
    raise exc


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
        self.metrics = NodeMetrics()
        self.metrics.capacity_bytes.set(cfg.capacity_bytes)
        self.metrics.tier_capacity_bytes.labels("ram").set(cfg.capacity_bytes)
        # the node's registry entry and index commits in Redis
        self.index = NodeIndex(cfg, self.pool, self.metrics, self.segment)
        # shared-memory reads in progress (kvstore/shm_ctl.py's get_shm)
        self.leases = ShmLeases(self.pool, self.metrics, cfg.shm_lease_s, self.segment)
        self._next_conn = 1
        self._conns: dict[int, Conn] = {}
        self._fp_sizes: dict[str, int] = {}  # layout fingerprint hex -> block bytes
        self._tasks: set[asyncio.Task[Any]] = set()
        self.ctl: CtlServer | None = None  # same-host get_shm channel (kvstore/shm_ctl.py)
        self.disk = (NodeDisk(cfg, self.pool, self.index, self.metrics, self._spawn)
                     if cfg.disk_path else None)
        #: OpenTelemetry (``contracts/tracing.py``): a request that carries a ``trace``
        #: context gets a span when the node traces
        self.tracing: Tracing = TRACING_OFF

    @property
    def redis_ok(self) -> bool:
        """Whether the last heartbeat reached Redis (the node's health)."""
        return self.index.redis_ok

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        init_ucx(self.cfg.ucx)
        self.index.ucx_address = worker_address()
        if self.segment is not None:
            ctl = CtlServer(self._pin_shm, self.leases.release_lease,
                            self.leases.release_leases_of)
            try:
                await ctl.start(ctl_address(self.cfg.node_id, self.segment.ident))
                self.ctl = ctl
            except OSError as exc:
                logger.warning("no shared-memory control socket (%s): clients read over UCX",
                               exc)
        if self.disk is not None:
            await self.disk.start()
        self._spawn(self._hello_loop())
        if not await self.index.heartbeat_once() and self.disk is not None:
            await self.disk.register()
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
        if self.disk is not None:
            # evicted blocks still waiting for their write reach the disk
            await self.disk.flush(self.cfg.transfer_timeout_s)
        for t in list(self._tasks):
            t.cancel()
        for c in self._conns.values():
            c.abort()
        if self.ctl is not None:
            await self.ctl.stop()
        await self.index.close()
        if self.disk is not None:
            await self.disk.close()
        if self.segment is not None:
            self.segment.close()

    # -- heartbeat and expiry -----------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_ttl_s / 3)
            await self.index.heartbeat_once()
            self._update_gauges()

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cfg.heartbeat_ttl_s / 3))
            gone = self.pool.expire()
            if gone:
                self.metrics.expirations.inc(len(gone))
                await self.index.try_commit(
                    [(e.key, self.index.entry(e).owner_prefix) for e in gone], [])
                self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.blocks_stored.set(self.pool.num_blocks)
        self.metrics.bytes_stored.set(self.pool.used_bytes)
        self.metrics.tier_blocks.labels("ram").set(self.pool.num_blocks)
        self.metrics.tier_bytes.labels("ram").set(self.pool.used_bytes)

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
            conn = Conn(conn_id, peer_conn, ep)
            self._conns[conn_id] = conn
            await conn.reply(0, {"op": "welcome", "conn_id": conn_id,
                                 "node_id": self.cfg.node_id})
            self._spawn(self._serve(conn))

    async def _serve(self, conn: Conn) -> None:
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
                if (msg.get("op") == "get" and self.disk is not None
                        and self.disk.wants(msg.get("keys"))):
                    work = self._get_from_disk(conn, request_id, msg)
                elif msg.get("op") == "get":
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

    async def _handle(self, conn: Conn, request_id: int, msg: dict[str, Any],
                      work: Coroutine[Any, Any, None] | None = None) -> None:
        """Serve one request; ``work``: a get already begun by :meth:`_begin_get`."""
        op = msg.get("op")
        span = None
        if self.tracing.enabled and "trace" in msg:
            span = request_span(self.tracing, op, msg)
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
        finally:
            if span is not None:
                span.end()

    async def _reply_error(self, conn: Conn, request_id: int, error: str) -> None:
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

    async def _put(self, conn: Conn, request_id: int, msg: dict[str, Any]) -> None:
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
            dropped, moved = self._evicted(evicted)
            for e in pending:
                self.pool.abort(e)
            await self.index.try_commit(*self._settle(dropped, moved))
            raise ValueError(str(exc)) from exc
        dropped, moved = self._evicted(evicted)
        for k, n in zip(keys, sizes, strict=True):
            self._fp_sizes.setdefault(k[len(INDEX_PREFIX):].partition(":")[0], n)
        if not formatted:
            # the slot size was just fixed: publish it now (clients use it to post
            # get receives before their request)
            self._spawn(self.index.heartbeat_once())
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
                await self.index.try_commit(*self._settle(dropped, moved))
        new = []
        mine = {id(e) for e in pending}
        for k in keys:
            found = self.pool.entries.get(k)
            if found is None or (not found.committed and id(found) not in mine):
                continue  # another put's pending write commits it
            ttl_ms = self.index.ttl_ms(found)
            if ttl_ms is not None:
                new.append((k, self.index.entry(found).encode(), ttl_ms))
        # NOTE: readable here before the index commit: a get that finds a fresh index
        # entry while the commit's reply is on its way must find the bytes too, or it
        # removes the entry as one whose payload is gone. Nobody finds them through
        # the index before the commit lands; if it fails they stay unindexed (evicted
        # in LRU order; a later put of the same key indexes them again).
        for e in pending:
            self.pool.commit(e)
        dropped, moved = self._settle(dropped, moved)
        committed = await self.index.try_commit(dropped, moved + new)
        if not committed:
            raise RuntimeError("index (Redis) unreachable: blocks not stored")
        self.metrics.put_bytes.inc(sum(e.size_bytes for e in pending))
        self.metrics.put_latency.observe(time.perf_counter() - t0)
        self._update_gauges()
        await conn.reply(request_id, {"op": "stored", "num_stored": len(new),
                                      "num_sent": len(pending)})

    def _evicted(self, evicted: list[Entry]
                 ) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]]]:
        """The index changes of blocks evicted from RAM: (entries to remove, entries to
        write); with a disk tier the blocks move there (their bytes are copied now,
        before their slots are written)."""
        if self.disk is not None:
            return self.disk.demote(evicted)
        return [(e.key, self.index.entry(e).owner_prefix) for e in evicted], []

    def _settle(self, dropped: list[tuple[str, str]], moved: list[tuple[str, str, int]]
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str, int]]]:
        """:meth:`_evicted`'s index changes as they stand now (NodeDisk.settle)."""
        return self.disk.settle(dropped, moved) if self.disk is not None else (dropped, moved)

    async def _get_from_disk(self, conn: Conn, request_id: int, msg: dict[str, Any]) -> None:
        """A get that asks for blocks in the disk tier: read them back into RAM, then
        serve it as any get."""
        assert self.disk is not None
        num_from_disk = await self.disk.promote(msg["keys"])
        await self._begin_get(conn, request_id, msg, num_from_disk)

    async def _pin_shm(self, conn_id: int, msg: dict[str, Any]) -> dict[str, Any]:
        """A same-host read's pins (ShmLeases.pin_shm), after blocks it asks for that
        are in the disk tier were read back into RAM."""
        num_from_disk = 0
        if self.disk is not None and self.disk.wants(msg.get("keys")):
            num_from_disk = await self.disk.promote(msg["keys"])
        return self.leases.pin_shm(conn_id, msg, num_from_disk)

    def _begin_get(self, conn: Conn, request_id: int, msg: dict[str, Any],
                   num_from_disk: int = 0) -> Coroutine[Any, Any, None]:
        """Pin the blocks of a get and start its reply and payload sends, without
        yielding to the loop; returns the coroutine that waits for the sends.

        NOTE: called by the connection's receive loop itself, not in a task of its
        own: the sends are posted one loop iteration sooner, and each iteration on
        the hot path costs a GIL hand-off with ucxx's notifier thread.

        ``num_from_disk``: of the blocks asked for, those just read back from the disk
        tier (counted as its hits, not RAM's).

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
            self.metrics.tier_hits.labels("ram").inc(max(0, len(held) - num_from_disk))
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

    async def _end_get(self, conn: Conn, sends: asyncio.Future[Any], held: list[Entry],
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

    async def _send_or_undo(self, send: Awaitable[Any], undo: Callable[[], None]) -> None:
        """Await a reply or payload send within the transfer timeout; if it fails (or
        is cancelled), run ``undo`` before the error propagates."""
        try:
            await within(send, self.cfg.transfer_timeout_s)
        except BaseException:
            undo()
            raise
