"""Prometheus metrics of a store node (names under ``tandem:kvstore_``).

Per tier (``tier`` label ``ram`` or ``disk``): blocks, bytes, capacity, hits and
evictions. ``tandem:kvstore_hits`` counts every block a get served; of those,
``tandem:kvstore_tier_hits{tier="disk"}`` were read back from the disk tier first.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# From a one-block batch on loopback up to 64 MiB batches on slower links (measured
# latencies: docs/benchmarks.md, "KV store transfer").
_LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0,
)


class NodeMetrics:
    """A node's metrics in their own registry (served on ``/metrics``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.blocks_stored = Gauge("tandem:kvstore_blocks_stored", "Blocks held", registry=r)
        self.bytes_stored = Gauge("tandem:kvstore_bytes_stored", "Payload bytes held", registry=r)
        self.capacity_bytes = Gauge("tandem:kvstore_capacity_bytes", "Pool size", registry=r)
        self.hits = Counter("tandem:kvstore_hits", "Blocks found on get", registry=r)
        self.misses = Counter("tandem:kvstore_misses", "Blocks missing on get", registry=r)
        self.evictions = Counter("tandem:kvstore_evictions", "Blocks evicted (LRU)", registry=r)
        self.expirations = Counter("tandem:kvstore_expirations", "Blocks dropped by TTL",
                                   registry=r)
        self.put_bytes = Counter("tandem:kvstore_put_bytes", "Payload bytes received",
                                 registry=r)
        self.get_bytes = Counter("tandem:kvstore_get_bytes", "Payload bytes sent", registry=r)
        self.errors = Counter("tandem:kvstore_errors", "Requests failed", ["reason"],
                              registry=r)
        self.tier_blocks = Gauge("tandem:kvstore_tier_blocks", "Blocks held per tier",
                                 ["tier"], registry=r)
        self.tier_bytes = Gauge("tandem:kvstore_tier_bytes",
                                "Bytes held per tier (disk: file bytes)", ["tier"], registry=r)
        self.tier_capacity_bytes = Gauge("tandem:kvstore_tier_capacity_bytes",
                                         "Capacity per tier", ["tier"], registry=r)
        self.tier_hits = Counter("tandem:kvstore_tier_hits",
                                 "Blocks a get found, by the tier they were in", ["tier"],
                                 registry=r)
        self.tier_evictions = Counter("tandem:kvstore_tier_evictions",
                                      "Blocks evicted (LRU) per tier", ["tier"], registry=r)
        self.disk_dropped = Counter(
            "tandem:kvstore_disk_dropped",
            "Blocks evicted from RAM not kept on disk (degraded, full, queue_full)",
            ["reason"], registry=r)
        self.disk_write_errors = Counter("tandem:kvstore_disk_write_errors",
                                         "Block file writes failed, by error", ["error"],
                                         registry=r)
        self.disk_corrupt = Counter(
            "tandem:kvstore_disk_corrupt_blocks",
            "Block files dropped (truncated, checksum, header, unreadable)", ["reason"],
            registry=r)
        self.disk_degraded = Gauge("tandem:kvstore_disk_degraded",
                                   "1 while the disk tier is off after a failed write",
                                   registry=r)
        self.disk_read_bytes = Counter("tandem:kvstore_disk_read_bytes",
                                       "Payload bytes read back from disk", registry=r)
        self.disk_write_bytes = Counter("tandem:kvstore_disk_write_bytes",
                                        "Payload bytes written to disk", registry=r)
        self.disk_read_latency = Histogram("tandem:kvstore_disk_read_latency_seconds",
                                           "One block file read and verified", registry=r,
                                           buckets=_LATENCY_BUCKETS_S)
        self.disk_write_latency = Histogram("tandem:kvstore_disk_write_latency_seconds",
                                            "One block file written and renamed", registry=r,
                                            buckets=_LATENCY_BUCKETS_S)
        self.put_latency = Histogram("tandem:kvstore_put_latency_seconds",
                                     "Batched put, request to commit", registry=r,
                                     buckets=_LATENCY_BUCKETS_S)
        self.get_latency = Histogram("tandem:kvstore_get_latency_seconds",
                                     "Batched get, request to last byte sent", registry=r,
                                     buckets=_LATENCY_BUCKETS_S)
