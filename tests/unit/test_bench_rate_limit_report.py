"""The arithmetic of ``tandem bench rate-limit``'s report (bench/rate_limit_report.py):
sliding and fixed one-minute windows over hand-made admissions, and the routers'
per-tenant counters read from ``/metrics`` text."""

from __future__ import annotations

from tandem.bench.rate_limit_report import (
    Admitted,
    build_report,
    diff_totals,
    fixed_minutes,
    max_any_window,
    metric_totals,
    sliding_windows,
    sum_totals,
)


def test_sliding_windows_start_on_whole_seconds_and_fit_in_the_run() -> None:
    times = [1000.5, 1010.0, 1059.9, 1060.5, 1080.0]
    weights = [10, 20, 30, 40, 50]
    w = sliding_windows(times, weights, start_s=1000.2, end_s=1081.0, step_s=10.0)
    # starts 1001, 1011, 1021 (1031 + 60 > 1081)
    assert w.starts_s == [1001.0, 1011.0, 1021.0]
    assert w.sums == [20 + 30 + 40, 30 + 40, 30 + 40 + 50]
    s = w.summary(limit=100)
    assert s == {"num_windows": 3, "max": 120, "mean": 280 / 3, "num_over_limit": 1,
                 "share_over_limit": 1 / 3}
    assert sliding_windows(times, weights, 1000.2, 1050.0, 5.0).summary(None) == {
        "num_windows": 0, "max": None, "mean": None}


def test_max_any_window_tries_every_start() -> None:
    # [1000.5, 1060.5) holds 10 + 20 + 30; the 1060.5 event is outside it
    assert max_any_window([1000.5, 1010.0, 1059.9, 1060.5], [10, 20, 30, 1]) == 60
    assert max_any_window([], []) == 0


def test_fixed_minutes_mark_the_partial_last_one() -> None:
    minutes = fixed_minutes([0.0, 59.9, 60.0, 130.0], [1, 2, 4, 8], 0.0, 150.0)
    assert minutes == [
        {"start_s": 0.0, "end_s": 60.0, "total": 3, "partial": False},
        {"start_s": 60.0, "end_s": 120.0, "total": 4, "partial": False},
        {"start_s": 120.0, "end_s": 150.0, "total": 8, "partial": True}]


METRICS = """\
# TYPE tandem:router_tenant_requests counter
tandem:router_tenant_requests_total{tenant="a"} 7.0
tandem:router_tenant_requests_total{tenant="b"} 100.0
# TYPE tandem:router_tenant_tokens counter
tandem:router_tenant_tokens_total{tenant="a"} 84.0
# TYPE tandem:router_rate_limited counter
tandem:router_rate_limited_total{limit="tokens_per_minute",tenant="a"} 5.0
tandem:router_rate_limited_total{limit="requests_per_minute",tenant="b"} 9.0
# TYPE tandem:router_rate_limit_errors counter
tandem:router_rate_limit_errors_total 1.0
"""


def test_metric_totals_of_one_tenant_summed_over_replicas_and_differenced() -> None:
    page = metric_totals(METRICS, "a")
    assert page == {"requests": 7.0, "tokens": 84.0,
                    "rate_limited": {"tokens_per_minute": 5.0}, "limiter_errors": 1.0}
    both = sum_totals([page, page])
    assert both["requests"] == 14.0 and both["rate_limited"] == {"tokens_per_minute": 10.0}
    assert diff_totals(both, page) == {"requests": 7, "tokens": 84,
                                       "rate_limited": {"tokens_per_minute": 5},
                                       "limiter_errors": 1}


def test_build_report_compares_the_router_with_the_client() -> None:
    admitted = [Admitted(10.0, 10.5, 8, 4), Admitted(11.0, 11.2, 8, 2)]
    router = {"requests": 2, "tokens": 22, "rate_limited": {"tokens_per_minute": 3},
              "limiter_errors": 0}
    report = build_report(admitted, [10.1, 10.2], 0, 10.0, 20.0, 5.0, 20, None, router)
    assert report["client"]["tokens"] == 22
    assert report["client"]["tokens_per_minute"] == 22 * 6
    assert report["router_matches_client"] == {"requests": True, "tokens": True,
                                               "rate_limited": False}
    assert report["sliding_windows"]["tokens"]["max_any_window"] == 22
    assert report["fixed_minutes"] == [{"start_s": 0.0, "end_s": 10.0, "partial": True,
                                        "tokens": 22, "requests": 2, "rate_limited": 2}]
