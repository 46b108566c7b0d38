"""The router's autoscaling signals: what KEDA or an HPA needs to size each role.

An autoscaler needs, per role, how much work waits and how close the engines are to
full, and, for the whole service, whether latency still meets its target. The router
sees all of it: it polls every engine's load (``GetLoad``, the Redis registry), it holds
the requests it has sent to prefill, and it times every token it streams. These series
(all ``tandem:router_*``) are refreshed from discovery when ``/metrics`` is scraped:

- ``tandem:router_role_num_requests_waiting{role}`` / ``..._running{role}``: the
  engines' own queues and running batches, summed over the role's live instances.
- ``tandem:router_role_kv_cache_usage_perc{role, stat="mean"|"max"}``: KV cache usage
  of the role's live instances, 0..1.
- ``tandem:router_role_num_instances{role}``: live instances of the role.
- ``tandem:router_prefill_backlog_tokens``: prompt tokens of the Prefill calls this
  router has outstanding (queued or computing at the prefill role); every router counts
  its own, so the fleet's backlog is the ``sum`` over routers.
- ``tandem:router_time_to_first_token_seconds_window{quantile}`` and
  ``tandem:router_inter_token_latency_seconds_window{quantile}``: p50/p90/p99 over the
  last ``window_s`` seconds (``metric_window``).

The per-role sums repeat on every router replica (each polls the same engines): an
autoscaler reads them with ``max`` across routers, the backlog with ``sum``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from tandem.contracts.role import Role
from tandem.services.router.metric_window import SlidingWindow, WindowCollector

#: Default width of the latency percentiles' window, s (``--metrics-window-s``).
DEFAULT_WINDOW_S = 60.0

TTFT_WINDOW = "tandem:router_time_to_first_token_seconds_window"
ITL_WINDOW = "tandem:router_inter_token_latency_seconds_window"


class ScalingMetrics:
    """The autoscaling series of one router, registered in its registry.

    Args:
        registry: the router's ``CollectorRegistry``.
        model_name: value of the ``model_name`` label of the latency windows.
        window_s: width of the TTFT / inter-token latency window, s.
        clock: monotonic seconds of the windows (``time.monotonic``).

    Raises:
        ValueError: naming ``window_s`` when it is not > 0.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        r = registry
        self.role_waiting = Gauge(
            "tandem:router_role_num_requests_waiting",
            "Requests queued on the role's live engines (their GetLoad reports, summed).",
            ["role"],
            registry=r,
        )
        self.role_running = Gauge(
            "tandem:router_role_num_requests_running",
            "Requests in the running batches of the role's live engines, summed.",
            ["role"],
            registry=r,
        )
        self.role_kv_usage = Gauge(
            "tandem:router_role_kv_cache_usage_perc",
            "KV cache usage of the role's live engines, 0..1: their mean (stat=mean) or "
            "the fullest one (stat=max).",
            ["role", "stat"],
            registry=r,
        )
        self.role_instances = Gauge(
            "tandem:router_role_num_instances",
            "Live engine instances of the role (those whose last load poll answered or "
            "that were not polled yet).",
            ["role"],
            registry=r,
        )
        self.prefill_backlog_tokens = Gauge(
            "tandem:router_prefill_backlog_tokens",
            "Prompt tokens of the Prefill calls this router has outstanding (queued or "
            "computing at the prefill role).",
            registry=r,
        )
        self.ttft_window = SlidingWindow(window_s, clock=clock)
        self.itl_window = SlidingWindow(window_s, clock=clock)
        registry.register(
            WindowCollector(
                model_name,
                (
                    (
                        TTFT_WINDOW,
                        f"Time to first token at the router over the last {window_s:g} s, "
                        "by quantile, s.",
                        self.ttft_window,
                    ),
                    (
                        ITL_WINDOW,
                        f"Inter-token latency at the router over the last {window_s:g} s, "
                        "by quantile, s.",
                        self.itl_window,
                    ),
                ),
            )
        )
        self.set_roles(())

    def set_roles(self, instances: Iterable[Any]) -> None:
        """Refresh the per-role series from discovery's ``InstanceInfo`` values (those
        whose last load poll failed, ``alive is False``, are left out). Every role gets
        its series, 0 without an instance, so a query for a role never comes back empty.
        """
        by_role: dict[str, list[Any]] = {role.value: [] for role in Role}
        for info in instances:
            if info.alive is not False:
                by_role.setdefault(str(info.role), []).append(info)
        for role, infos in by_role.items():
            usage = [float(i.kv_usage) for i in infos]
            self.role_waiting.labels(role=role).set(sum(i.waiting for i in infos))
            self.role_running.labels(role=role).set(sum(i.running for i in infos))
            self.role_instances.labels(role=role).set(len(infos))
            self.role_kv_usage.labels(role=role, stat="mean").set(
                sum(usage) / len(usage) if usage else 0.0
            )
            self.role_kv_usage.labels(role=role, stat="max").set(max(usage, default=0.0))

    @contextlib.contextmanager
    def prefill_in_flight(self, num_prompt_tokens: int) -> Iterator[None]:
        """Counts ``num_prompt_tokens`` in the prefill backlog for the ``with`` body (one
        Prefill call, from sending it to its answer or failure)."""
        self.prefill_backlog_tokens.inc(num_prompt_tokens)
        try:
            yield
        finally:
            self.prefill_backlog_tokens.dec(num_prompt_tokens)
