"""A store node's shared-memory reads (served on the control socket,
kvstore/shm_ctl.py): the pins of a ``get_shm`` request, held as a lease until the
reading connection releases it, closes, or the lease expires.

Runs on the node's event loop (kvstore/node.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tandem.kvstore import protocol as proto
from tandem.kvstore.metrics import NodeMetrics
from tandem.kvstore.pool import Entry, SlotPool
from tandem.kvstore.shm import Segment

# the node's parts log under one name (kvstore/node.py's)
logger = logging.getLogger("tandem.kvstore.server")


class ShmLeases:
    """Leases of same-host reads: blocks pinned in the shared segment, by (connection
    id, lease id); only the connection that got a lease releases it.

    Args:
        lease_s: how long a lease holds its pins unreleased (``NodeConfig.shm_lease_s``).
        segment: the pool's shared-memory segment (``None``: every ``get_shm`` is refused).
    """

    def __init__(self, pool: SlotPool, metrics: NodeMetrics, lease_s: float,
                 segment: Segment | None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.lease_s = lease_s
        self.segment = segment
        # (connection id, lease id) -> (blocks pinned, expiry timer, start)
        self._leases: dict[tuple[int, int], tuple[list[Entry], asyncio.TimerHandle, float]] = {}
        self._next_lease = 1

    def pin_shm(self, conn_id: int, msg: dict[str, Any],
                num_from_disk: int = 0) -> dict[str, Any]:
        """Pin the blocks a ``get_shm`` request names; returns the ``shm`` reply with
        their offsets in the shared segment (kvstore/protocol.py). ``num_from_disk``:
        of them, those just read back from the node's disk tier (counted as its hits).

        The blocks stay pinned (not evicted, not overwritten) until connection
        ``conn_id`` releases the lease, closes, or ``lease_s`` passes.

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
        self.metrics.tier_hits.labels("ram").inc(max(0, len(held) - num_from_disk))
        self.metrics.misses.inc(len(keys) - len(held))
        lease = 0
        if held:
            lease = self._next_lease
            self._next_lease += 1
            timer = asyncio.get_running_loop().call_later(
                self.lease_s, self._expire_lease, conn_id, lease)
            self._leases[conn_id, lease] = (held, timer, t0)
        return {"op": "shm", "lease": lease,
                "offsets": [self.pool.offset(e.slot) if e else -1 for e in entries],
                "sizes": [e.size_bytes if e else 0 for e in entries]}

    def release_lease(self, conn_id: int, lease: Any, expired: bool = False) -> None:
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

    def release_leases_of(self, conn_id: int) -> None:
        """Unpin every lease a closed connection still holds."""
        for cid, lease in [k for k in self._leases if k[0] == conn_id]:
            self.release_lease(cid, lease, expired=True)

    def _expire_lease(self, conn_id: int, lease: int) -> None:
        if (conn_id, lease) in self._leases:
            logger.warning("shared-memory read lease %d of connection %d not released "
                           "within %.1fs: unpinned", lease, conn_id, self.lease_s)
            self.metrics.errors.labels("lease_expired").inc()
            self.release_lease(conn_id, lease, expired=True)
