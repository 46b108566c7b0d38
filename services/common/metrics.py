"""Prometheus metrics of an engine service, vLLM's names under ``tandem:``.

One ``CollectorRegistry`` per service (no global state), served over HTTP on
``--metrics-port`` at ``/metrics``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tandem.contracts.role import Role

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServiceMetrics:
    """The metrics of one instance.

    Args:
        role: this instance's role; its value is a label on every metric.
    """

    def __init__(self, role: Role) -> None:
        self.registry = CollectorRegistry()
        labels = ["role"]
        r = self.registry
        self._request_metrics(r, labels)
        self._kv_transfer_metrics(r, labels)
        self._step_metrics(r, labels)
        self._cache_metrics(r, labels)
        self._role = Role(role).value
        self._followed: dict[str, float] = {}

    def _request_metrics(self, r: CollectorRegistry, labels: list[str]) -> None:
        """Requests: running and waiting, KV usage, outcomes, time to first token."""
        self.num_requests_running = Gauge(
            "tandem:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.num_requests_waiting = Gauge(
            "tandem:num_requests_waiting", "Requests queued.", labels, registry=r)
        self.kv_cache_usage_perc = Gauge(
            "tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", labels,
            registry=r)
        self.request_success = Counter(
            "tandem:request_success", "Finished requests by finish reason.",
            [*labels, "finished_reason"], registry=r)
        self.time_to_first_token = Histogram(
            "tandem:time_to_first_token_seconds", "Arrival at this engine -> first token, s.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r)

    def _kv_transfer_metrics(self, r: CollectorRegistry, labels: list[str]) -> None:
        """The KV store's transfers: publishes, pulls, their waits and failures."""
        self.kv_publish_seconds = Histogram(
            "tandem:kv_publish_seconds", "First token -> KV blocks published (prefill), s.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.kv_pull_seconds = Histogram(
            "tandem:kv_pull_seconds", "Arrival -> remote KV loaded (decode), s.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.num_kv_loads_waiting = Gauge(
            "tandem:num_kv_loads_waiting",
            "Remote KV loads (decode) parked until blocks a prefill is still publishing "
            "arrive.", labels, registry=r)
        self.kv_load_waits = Counter(
            "tandem:kv_load_waits",
            "Remote KV loads (decode) that waited for blocks the prefill was still "
            "publishing, by how the wait ended (arrived, published, publish_failed, "
            "deadline, index_error, cancelled, closed).",
            [*labels, "outcome"], registry=r)
        self.kv_load_wait_seconds = Histogram(
            "tandem:kv_load_wait_seconds",
            "Time a remote KV load (decode) waited for blocks still being published, s.",
            labels, buckets=_LATENCY_BUCKETS_S, registry=r)
        self.kv_lookup_waits = Counter(
            "tandem:kv_lookup_waits",
            "Store lookups that waited for blocks an earlier request's output publish "
            "was still writing (the next turn of a chat), by how the wait ended.",
            [*labels, "outcome"], registry=r)
        self.kv_load_failures = Counter(
            "tandem:kv_load_failures",
            "Requests whose remote KV was missing or corrupt and got recomputed.",
            labels, registry=r)

    def _step_metrics(self, r: CollectorRegistry, labels: list[str]) -> None:
        """Steps: preemptions and speculative decoding."""
        self.num_preemptions = Counter(
            "tandem:num_preemptions", "Requests preempted (their KV freed, recomputed later).",
            labels, registry=r)
        # Speculative decoding (vLLM's spec_decode_* counters; zero when it is off).
        self.spec_decode_num_drafts = Counter(
            "tandem:spec_decode_num_drafts", "Verifications of draft tokens (request-steps).",
            labels, registry=r)
        self.spec_decode_num_draft_tokens = Counter(
            "tandem:spec_decode_num_draft_tokens", "Draft tokens verified.", labels, registry=r)
        self.spec_decode_num_accepted_tokens = Counter(
            "tandem:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
            registry=r)
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0-based).",
            [*labels, "position"], registry=r)

    def _cache_metrics(self, r: CollectorRegistry, labels: list[str]) -> None:
        """Cache tiers, output publishes, CPU turns and the KV cache and weights sizes."""
        # Per cache tier: "local" (this engine's prefix cache), "store" (the KV store,
        # through the connector); queries count each admitted request's tokens, so
        # hits / queries is the tier's hit rate.
        self.prefix_cache_queries = Counter(
            "tandem:prefix_cache_queries", "Prompt tokens looked up, per cache tier.",
            [*labels, "tier"], registry=r)
        self.prefix_cache_hits = Counter(
            "tandem:prefix_cache_hits", "Prompt tokens served from a cache tier (not computed).",
            [*labels, "tier"], registry=r)
        self.kv_output_publishes = Counter(
            "tandem:kv_output_publishes",
            "Finished requests whose prompt + output blocks were published (decode), by outcome.",
            [*labels, "outcome"], registry=r)
        self.cpu_turn_wait_seconds = Counter(
            "tandem:cpu_turn_wait_seconds",
            "Time model steps waited for their turn on CPU cores shared with other engines "
            "(--shared-cpu-lock), s.", labels, registry=r)
        self.kv_cache_bytes_per_token = Gauge(
            "tandem:kv_cache_bytes_per_token",
            "KV cache bytes per token, all layers (what the KV store moves per token; "
            "--kv-cache-dtype fp8 halves a 16-bit model's).", labels, registry=r)
        self.kv_cache_capacity_tokens = Gauge(
            "tandem:kv_cache_capacity_tokens", "Tokens the KV cache holds (blocks x block size).",
            labels, registry=r)
        self.model_weight_bytes = Gauge(
            "tandem:model_weight_bytes",
            "Bytes of the model's weights in memory on the driver rank (quantized weights "
            "count their packed size; what they free goes to the KV cache).", labels,
            registry=r)

    def labels(self, metric: Any, **extra: str) -> Any:
        """``metric`` with this instance's role label (and ``extra`` labels)."""
        return metric.labels(role=self._role, **extra)

    def observe_stats(self, stats: Any, num_kv_load_failures: int,
                      num_kv_loads_waiting: int = 0,
                      kv_lookup_waits: dict[str, int] | None = None,
                      cpu_turn_wait_s: float = 0.0) -> None:
        """Refresh the gauges from the scheduler's stats (and the connector's counts, and
        the engine's total wait for CPU turns in seconds)."""
        self.labels(self.num_requests_running).set(stats.num_running)
        self._follow("cpu_turn_wait_seconds", self.cpu_turn_wait_seconds, cpu_turn_wait_s)
        for outcome, total in (kv_lookup_waits or {}).items():
            self._follow(f"kv_lookup_waits:{outcome}", self.kv_lookup_waits, total,
                         outcome=outcome)
        self.labels(self.num_kv_loads_waiting).set(num_kv_loads_waiting)
        self.labels(self.num_requests_waiting).set(stats.num_waiting)
        self.labels(self.kv_cache_usage_perc).set(stats.kv_cache_usage)
        self._follow("kv_load_failures", self.kv_load_failures, num_kv_load_failures)
        self._follow("num_preemptions", self.num_preemptions, stats.num_preemptions)
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            self._follow("spec_decode_num_drafts", self.spec_decode_num_drafts, spec.num_drafts)
            self._follow("spec_decode_num_draft_tokens", self.spec_decode_num_draft_tokens,
                         spec.num_draft_tokens)
            self._follow("spec_decode_num_accepted_tokens", self.spec_decode_num_accepted_tokens,
                         spec.num_accepted_tokens)
            for pos, total in enumerate(spec.num_accepted_tokens_per_pos):
                self._follow(f"spec_decode_num_accepted_tokens_per_pos:{pos}",
                             self.spec_decode_num_accepted_tokens_per_pos, total,
                             position=str(pos))
        tiers = {
            "local": (stats.prefix_cache_queries, stats.prefix_cache_hits),
            "store": (stats.connector_prefix_cache_queries, stats.connector_prefix_cache_hits),
        }
        for tier, (queries, hits) in tiers.items():
            self._follow(f"queries:{tier}", self.prefix_cache_queries, queries, tier=tier)
            self._follow(f"hits:{tier}", self.prefix_cache_hits, hits, tier=tier)

    def _follow(self, key: str, counter: Counter, total: float, **extra: str) -> None:
        """Advance ``counter`` (with ``extra`` labels) to ``total``: the engine (or
        connector) counts, the Prometheus counter follows its increments."""
        delta = total - self._followed.get(key, 0)
        if delta > 0:
            self.labels(counter, **extra).inc(delta)
            self._followed[key] = total

    def serve(self, port: int) -> Any:
        """Serve ``/metrics`` on ``port`` in a daemon thread; returns the server (``.shutdown()``)."""
        server, _thread = start_http_server(port, registry=self.registry)
        return server
