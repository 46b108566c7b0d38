"""A store node's entries in Redis (kvstore/index.py's schema): its registry hash,
refreshed by the heartbeat (and its blocks' index entries published again when the hash
was lost), and the commits that add and remove its blocks' index entries.

Runs on the node's event loop (kvstore/node.py), which owns the loops that call it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.kvstore.config import NodeConfig
from tandem.kvstore.index import COMMIT_LUA, NODES_SET, IndexEntry, commit_args, node_key
from tandem.kvstore.metrics import NodeMetrics
from tandem.kvstore.pool import Entry, SlotPool
from tandem.kvstore.shm import Segment, host_id

# the node's parts log under one name (kvstore/node.py's)
logger = logging.getLogger("tandem.kvstore.server")


class NodeIndex:
    """The node's registry entry and its blocks' index entries in Redis.

    ``redis_ok``: whether the last heartbeat reached Redis (the node's health).
    ``ucx_address``: the node's UCX worker address, published in the registry once
    the node set it.
    """

    def __init__(self, cfg: NodeConfig, pool: SlotPool, metrics: NodeMetrics,
                 segment: Segment | None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self.segment = segment
        self.redis = aioredis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._commit = self.redis.register_script(COMMIT_LUA)
        self.redis_ok = False
        self.ucx_address = b""
        #: (key, entry) of the node's blocks outside its RAM pool (its disk tier,
        #: kvstore/node_disk.py): republished and withdrawn with the pool's
        self.disk_entries: Callable[[], list[tuple[str, IndexEntry]]] = list

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

    async def heartbeat_once(self) -> bool:
        """Refresh the registry entry (its TTL too); publish the index entries again
        when the entry was gone. A failure sets ``redis_ok`` False, never raises.
        Returns whether the index entries were published again."""
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
            return False
        republish = not existed and (self.pool.num_blocks or self.disk_entries())
        if republish:
            # Registry entry was gone: Redis restarted (or we were partitioned long
            # enough to expire). Re-publish what this node holds.
            await self._republish()
        self.redis_ok = True
        return bool(republish)

    async def _republish(self) -> None:
        new = [(k, e.encode(), 0) for k, e in self.disk_entries()]
        for key in self.pool.lru_keys():
            e = self.pool.entries[key]
            ttl_ms = self.ttl_ms(e)
            if ttl_ms is None:
                continue
            new.append((key, self.entry(e).encode(), ttl_ms))
        # NOTE: in parts, so that a large disk tier does not make one long Lua call
        for i in range(0, len(new), 1000):
            keys, argv = commit_args([], new[i : i + 1000])
            await self._commit(keys=keys, args=argv)
        if new:
            logger.info("re-published %d index entries after a registry loss", len(new))

    def entry(self, e: Entry) -> IndexEntry:
        """The index entry of pool entry ``e`` on this node."""
        return IndexEntry(self.cfg.node_id, e.slot, e.size_bytes, e.checksum)

    @staticmethod
    def ttl_ms(e: Entry) -> int | None:
        """Remaining TTL in ms (0: none); ``None`` if already expired."""
        if e.expires_at is None:
            return 0
        left = e.expires_at - time.monotonic()
        return int(left * 1000) if left > 0.001 else None

    async def try_commit(self, evicted: list[tuple[str, str]],
                         new: list[tuple[str, str, int]]) -> bool:
        """Remove ``evicted`` (key, owner prefix) index entries and add ``new`` (key,
        encoded entry, TTL in ms) in one commit; False if Redis failed (logged,
        counted)."""
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

    async def close(self) -> None:
        """Withdraw the node and its index entries, then close the Redis client."""
        # a clean stop withdraws the node and its index entries (a killed node's
        # entries are misses, removed by the clients that find them)
        gone = [(k, self.entry(self.pool.entries[k]).owner_prefix) for k in self.pool.lru_keys()]
        gone += [(k, e.owner_prefix) for k, e in self.disk_entries()]
        await self.try_commit(gone, [])
        try:
            await self.redis.delete(node_key(self.cfg.node_id))
        except (RedisError, OSError):
            pass
        await self.redis.aclose()
