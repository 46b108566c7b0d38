"""Prometheus metrics of the router: vLLM's metric names under ``tandem:router_``.

One :class:`RouterMetrics` per app owns its own ``CollectorRegistry`` (no global state, so
several routers in one test process do not collide). Request-level series are observed by
the pipeline; per-instance gauges (KV usage, prefix-cache hit rate, queue lengths) and the
per-role sums an autoscaler reads (``scaling_metrics.ScalingMetrics``) are refreshed from
discovery each time ``/metrics`` is scraped.

Names follow vLLM v1 (``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``) with ``router_`` after the prefix: the engines export the
same concepts under ``tandem:`` (``services/common/metrics.py``) measured at the engine,
and one Prometheus scraping both must never mix the router's TTFT (arrival at the router
to the first token sent) with an engine's (arrival at that engine). The KV handoff series
are ours.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tandem.services.router.scaling_metrics import DEFAULT_WINDOW_S, ScalingMetrics

# Buckets from vLLM's metrics (seconds).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_HANDOFF_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """The router's Prometheus series.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        window_s: width in seconds of the sliding window of the TTFT and inter-token
            latency percentiles (``--metrics-window-s``).
        clock: monotonic seconds of that window (``time.monotonic``).

    Raises:
        ValueError: naming ``window_s`` when it is not > 0.
    """

    def __init__(
        self,
        model_name: str,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._children: dict[int, Any] = {}  # id(metric) -> its series for model_name
        self._add_request_series(self.registry)
        self._add_kv_series(self.registry)
        self._add_instance_series(self.registry)
        self.scaling = ScalingMetrics(self.registry, model_name, window_s, clock)

    def _add_request_series(self, r: CollectorRegistry) -> None:
        """Per-request latencies, token counts, outcomes and admission gauges."""
        lbl = ["model_name"]
        self.ttft = Histogram(
            "tandem:router_time_to_first_token_seconds",
            "Time to first token (router arrival to first token sent), s.",
            lbl,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem:router_inter_token_latency_seconds",
            "Time between consecutive tokens of a request, s.",
            lbl,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem:router_e2e_request_latency_seconds",
            "End-to-end request latency at the router, s.",
            lbl,
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem:router_prompt_tokens", "Prompt tokens processed.", lbl, registry=r
        )
        self.generation_tokens = Counter(
            "tandem:router_generation_tokens", "Tokens generated.", lbl, registry=r
        )
        self.request_success = Counter(
            "tandem:router_request_success",
            "Finished requests by finish reason.",
            lbl + ["finished_reason"],
            registry=r,
        )
        self.num_running = Gauge(
            "tandem:router_num_requests_running",
            "Requests in prefill or decode at the router.",
            lbl,
            registry=r,
        )
        self.num_waiting = Gauge(
            "tandem:router_num_requests_waiting",
            "Requests admitted by the router, waiting for a prefill.",
            lbl,
            registry=r,
        )
        self.retries = Counter(
            "tandem:router_request_retries",
            "Prefill/decode calls retried on another instance.",
            lbl + ["stage"],
            registry=r,
        )
        self.migrations = Counter(
            "tandem:router_request_migrations",
            "Completions continued on another instance after the one "
            "streaming them failed mid-stream.",
            lbl,
            registry=r,
        )

    def _add_kv_series(self, r: CollectorRegistry) -> None:
        """The KV handoff, store lookups and the disaggregation decision."""
        lbl = ["model_name"]
        self.kv_publish_hints = Counter(
            "tandem:router_kv_publish_hints",
            "Requests sent with a hint that an earlier request's output publish may still "
            "be writing some of their prompt's blocks (a chat's next turn right after the "
            "previous answer).",
            lbl,
            registry=r,
        )
        self.kv_handoff_bytes = Counter(
            "tandem:router_kv_handoff_bytes",
            "KV bytes moved from prefill to decode via the store.",
            lbl,
            registry=r,
        )
        self.kv_handoff_seconds = Histogram(
            "tandem:router_kv_handoff_seconds",
            "Time to move one request's KV blocks, s.",
            lbl,
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self.disagg_decision = Counter(
            "tandem:router_disagg_decision",
            "Disaggregated-mode requests by path: remote_prefill (a prefill instance) or "
            "local_prefill (the decode instance prefills the prompt itself: a short "
            "uncached part, a full prefill queue, or no prefill instance able to serve).",
            lbl + ["path"],
            registry=r,
        )
        self.kv_store_lookup_seconds = Histogram(
            "tandem:router_kv_store_lookup_seconds",
            "One request's batched lookup of the KV store index (routing), s.",
            lbl,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=r,
        )

    def _add_instance_series(self, r: CollectorRegistry) -> None:
        """Per-instance load gauges, refreshed by :meth:`set_instances`."""
        inst = ["instance", "role"]
        self.inst_kv_usage = Gauge(
            "tandem:router_instance_kv_cache_usage_perc",
            "KV cache usage of an instance, 0..1.",
            inst,
            registry=r,
        )
        self.inst_running = Gauge(
            "tandem:router_instance_num_requests_running",
            "Requests running on an instance.",
            inst,
            registry=r,
        )
        self.inst_waiting = Gauge(
            "tandem:router_instance_num_requests_waiting",
            "Requests waiting on an instance.",
            inst,
            registry=r,
        )
        self.inst_hit_rate = Gauge(
            "tandem:router_instance_prefix_cache_hit_rate",
            "Prefix-cache hit rate of an instance (tokens), 0..1.",
            inst,
            registry=r,
        )

    def labels(self, metric):  # noqa: ANN001, ANN201 - prometheus child types are untyped
        """``metric``'s series for this router's model (looked up once: several calls
        per streamed token)."""
        child = self._children.get(id(metric))
        if child is None:
            child = self._children[id(metric)] = metric.labels(model_name=self.model_name)
        return child

    def observe_ttft(self, ttft_s: float) -> None:
        """One request's time to first token, s (the histogram and the window)."""
        self.labels(self.ttft).observe(ttft_s)
        self.scaling.ttft_window.observe(ttft_s)

    def observe_itl(self, itl_s: float) -> None:
        """One inter-token latency, s (the histogram and the window)."""
        self.labels(self.itl).observe(itl_s)
        self.scaling.itl_window.observe(itl_s)

    def set_instances(self, instances: Iterable) -> None:  # noqa: ANN001
        """Replace the per-instance gauges and the per-role sums with the given
        ``InstanceInfo`` values."""
        instances = list(instances)
        self.scaling.set_roles(instances)
        for g in (self.inst_kv_usage, self.inst_running, self.inst_waiting, self.inst_hit_rate):
            g.clear()
        for info in instances:
            key = {"instance": info.address, "role": info.role}
            self.inst_kv_usage.labels(**key).set(info.kv_usage)
            self.inst_running.labels(**key).set(info.running)
            self.inst_waiting.labels(**key).set(info.waiting)
            if info.prefix_cache_hit_rate is not None:
                self.inst_hit_rate.labels(**key).set(info.prefix_cache_hit_rate)

    def render(self) -> bytes:
        """The exposition text of every series."""
        return generate_latest(self.registry)
