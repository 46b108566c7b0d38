"""The router's autoscaling series: sliding-window percentiles and per-role sums.

Pure: a hand-driven clock moves the window; the exposition text comes from the real
prometheus_client registry the router serves.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.contracts.role import Role
from tandem.services.router.discovery import InstanceInfo
from tandem.services.router.metric_window import SlidingWindow, quantile
from tandem.services.router.metrics import RouterMetrics


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return _samples(metrics).get((name, tuple(sorted(labels.items()))))


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_quantile_is_numpys_linear(n: int) -> None:
    rng = random.Random(n)
    values = sorted(rng.uniform(0, 5) for _ in range(n))
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), abs=1e-12)


def test_quantile_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match="q must be in"):
        quantile([1.0], 1.5)
    with pytest.raises(ValueError, match="window_s"):
        SlidingWindow(0)
    with pytest.raises(ValueError, match="max_samples"):
        SlidingWindow(1, max_samples=0)


def test_window_forgets_samples_older_than_its_width() -> None:
    clock = _Clock()
    w = SlidingWindow(60, clock=clock)
    assert w.quantiles() is None
    w.observe(5.0)
    clock.now += 30
    w.observe(1.0)
    w.observe(2.0)
    assert w.values() == [1.0, 2.0, 5.0]
    clock.now += 30.5  # the 5.0 is now 60.5 s old
    assert w.values() == [1.0, 2.0]
    assert w.quantiles((0.5,)) == [1.5]
    clock.now += 30
    assert w.quantiles() is None


def test_window_keeps_at_most_max_samples() -> None:
    w = SlidingWindow(60, max_samples=3, clock=_Clock())
    for v in (9.0, 8.0, 1.0, 2.0, 3.0):
        w.observe(v)
    assert w.values() == [1.0, 2.0, 3.0]


def test_ttft_and_itl_windows_on_metrics() -> None:
    clock = _Clock()
    m = RouterMetrics("m", window_s=10, clock=clock)
    name = "tandem:router_time_to_first_token_seconds_window"
    assert _value(m, name, model_name="m", quantile="0.9") is None  # no traffic, no value
    assert _value(m, f"{name}_samples", model_name="m") == 0
    for ttft in range(1, 11):
        m.observe_ttft(ttft / 10)
    m.observe_itl(0.05)
    assert _value(m, name, model_name="m", quantile="0.5") == pytest.approx(0.55)
    assert _value(m, name, model_name="m", quantile="0.9") == pytest.approx(0.91)
    assert _value(m, name, model_name="m", quantile="0.99") == pytest.approx(0.991)
    assert _value(m, f"{name}_samples", model_name="m") == 10
    assert _value(
        m, "tandem:router_inter_token_latency_seconds_window", model_name="m", quantile="0.99"
    ) == pytest.approx(0.05)
    # The histograms still see every sample.
    assert _value(m, "tandem:router_time_to_first_token_seconds_count", model_name="m") == 10
    clock.now += 11
    assert _value(m, name, model_name="m", quantile="0.5") is None
    assert _value(m, "tandem:router_time_to_first_token_seconds_count", model_name="m") == 10


def test_role_sums_over_live_instances() -> None:
    m = RouterMetrics("m")
    m.set_instances(
        [
            InstanceInfo(Role.PREFILL, "p1:1", running=2, waiting=3, kv_usage=0.5, alive=True),
            InstanceInfo(Role.PREFILL, "p2:1", running=1, waiting=4, kv_usage=0.25),  # not polled
            InstanceInfo(Role.PREFILL, "p3:1", running=9, waiting=9, kv_usage=1.0, alive=False),
            InstanceInfo(Role.DECODE, "d1:1", running=5, waiting=0, kv_usage=0.75, alive=True),
        ]
    )
    prefill, decode, both = {"role": "prefill"}, {"role": "decode"}, {"role": "both"}
    assert _value(m, "tandem:router_role_num_requests_waiting", **prefill) == 7
    assert _value(m, "tandem:router_role_num_requests_running", **prefill) == 3
    assert _value(m, "tandem:router_role_num_instances", **prefill) == 2
    assert _value(
        m, "tandem:router_role_kv_cache_usage_perc", stat="mean", **prefill
    ) == pytest.approx(0.375)
    assert _value(m, "tandem:router_role_kv_cache_usage_perc", stat="max", **prefill) == 0.5
    assert _value(m, "tandem:router_role_num_requests_running", **decode) == 5
    assert _value(m, "tandem:router_role_kv_cache_usage_perc", stat="max", **decode) == 0.75
    # A role without instances reads 0, not nothing: an autoscaler's query never comes
    # back empty.
    assert _value(m, "tandem:router_role_num_instances", **both) == 0
    assert _value(m, "tandem:router_role_kv_cache_usage_perc", stat="mean", **both) == 0
    # The per-instance series keep every instance, the dead one too.
    assert (
        _value(m, "tandem:router_instance_num_requests_waiting", instance="p3:1", role="prefill")
        == 9
    )
    m.set_instances([])
    assert _value(m, "tandem:router_role_num_requests_waiting", **prefill) == 0


def test_prefill_backlog_counts_outstanding_prompt_tokens() -> None:
    m = RouterMetrics("m")
    name = "tandem:router_prefill_backlog_tokens"
    with m.scaling.prefill_in_flight(40):
        with m.scaling.prefill_in_flight(7):
            assert _value(m, name) == 47
        with pytest.raises(RuntimeError), m.scaling.prefill_in_flight(100):
            raise RuntimeError("the Prefill call failed")
        assert _value(m, name) == 40
    assert _value(m, name) == 0
