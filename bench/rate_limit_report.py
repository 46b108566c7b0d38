"""The numbers of ``tandem bench rate-limit``: admitted tokens per window against a limit,
and the routers' per-tenant counters against the client's own count.

Pure functions over the client's records (no I/O besides parsing ``/metrics`` text), so
the arithmetic is testable without a stack.

Times are wall-clock seconds since the epoch. A request counts at the moment the client
sent it: the router charges it to its tenant on arrival (after tokenizing, before any
engine), so the send time is the admission time up to the router's own few milliseconds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

#: The limiter's window (services/router/rate_limit.py), in seconds.
WINDOW_S = 60.0

#: The router's per-tenant series, as ``/metrics`` names the samples.
REQUESTS_METRIC = "tandem:router_tenant_requests_total"
TOKENS_METRIC = "tandem:router_tenant_tokens_total"
REFUSED_METRIC = "tandem:router_rate_limited_total"
ERRORS_METRIC = "tandem:router_rate_limit_errors_total"


@dataclass(frozen=True)
class Admitted:
    """One request the router admitted and answered.

    Attributes:
        sent_s: when the client sent it (epoch seconds).
        done_s: when its answer arrived (epoch seconds).
        prompt_tokens / completion_tokens: its ``usage`` (tokens).
    """

    sent_s: float
    done_s: float
    prompt_tokens: int
    completion_tokens: int

    @property
    def num_tokens(self) -> int:
        """Tokens charged to its tenant: prompt + completion."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Windows:
    """Sums of one quantity over windows of ``WINDOW_S``.

    Attributes:
        starts_s: each window's start (epoch seconds).
        sums: each window's total (tokens or requests).
    """

    starts_s: list[float]
    sums: list[int]

    def summary(self, limit: int | None) -> dict[str, Any]:
        """Count, max, mean and (with ``limit``) the share of windows over it."""
        out: dict[str, Any] = {"num_windows": len(self.sums),
                               "max": max(self.sums) if self.sums else None,
                               "mean": sum(self.sums) / len(self.sums) if self.sums else None}
        if limit is not None:
            over = sum(1 for s in self.sums if s > limit)
            out["num_over_limit"] = over
            out["share_over_limit"] = over / len(self.sums) if self.sums else None
        return out


def _window_sums(times_s: Sequence[float], weights: Sequence[int],
                 starts_s: Sequence[float]) -> list[int]:
    """For each start ``s``, the weights of the (sorted) ``times_s`` in ``[s, s + 60)``."""
    prefix = [0, *accumulate(weights)]
    return [prefix[bisect.bisect_left(times_s, s + WINDOW_S)] - prefix[bisect.bisect_left(times_s, s)]
            for s in starts_s]


def sliding_windows(times_s: Sequence[float], weights: Sequence[int], start_s: float,
                    end_s: float, step_s: float) -> Windows:
    """Windows ``[s, s + 60)`` stepped by ``step_s`` that lie within ``[start_s, end_s]``.

    NOTE: the starts are whole epoch seconds, the limiter's one-second bucket edges: a
    window then covers exactly the 60 buckets the limiter sums at that window's last
    second, so a window over the limit is the limiter admitting more than it should,
    not a window straddling bucket edges (``max_any_window`` measures that).
    """
    if step_s <= 0:
        raise ValueError(f"step_s: must be > 0, got {step_s}")
    starts: list[float] = []
    s = float(math.ceil(start_s))
    while s + WINDOW_S <= end_s + 1e-9:
        starts.append(s)
        s += step_s
    return Windows(starts, _window_sums(times_s, weights, starts))


def max_any_window(times_s: Sequence[float], weights: Sequence[int]) -> int:
    """The most any window of ``WINDOW_S`` held, wherever it starts (the worst window
    starts at an event, so only those are tried)."""
    return max(_window_sums(times_s, weights, times_s), default=0)


def fixed_minutes(times_s: Sequence[float], weights: Sequence[int], start_s: float,
                  end_s: float) -> list[dict[str, Any]]:
    """Consecutive minutes from ``start_s``: each one's start and end (seconds into the
    run), total, and whether it is a partial last minute."""
    out = []
    m = 0
    while start_s + m * WINDOW_S < end_s - 1e-9:
        lo = start_s + m * WINDOW_S
        hi = min(lo + WINDOW_S, end_s)
        i, j = bisect.bisect_left(times_s, lo), bisect.bisect_left(times_s, hi)
        out.append({"start_s": lo - start_s, "end_s": hi - start_s,
                    "total": sum(weights[i:j]), "partial": hi - lo < WINDOW_S - 1e-9})
        m += 1
    return out


def metric_totals(text: str, tenant: str) -> dict[str, Any]:
    """The router's counters for ``tenant`` in one ``/metrics`` page: admitted requests,
    charged tokens, refusals by limit, and the limiter's store errors (all tenants)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"requests": 0.0, "tokens": 0.0, "rate_limited": {},
                           "limiter_errors": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ERRORS_METRIC:
                out["limiter_errors"] += sample.value
            if sample.labels.get("tenant") != tenant:
                continue
            if sample.name == REQUESTS_METRIC:
                out["requests"] += sample.value
            elif sample.name == TOKENS_METRIC:
                out["tokens"] += sample.value
            elif sample.name == REFUSED_METRIC:
                limit = sample.labels.get("limit", "")
                out["rate_limited"][limit] = out["rate_limited"].get(limit, 0.0) + sample.value
    return out


def sum_totals(pages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``metric_totals`` of every replica added up."""
    out: dict[str, Any] = {"requests": 0.0, "tokens": 0.0, "rate_limited": {},
                           "limiter_errors": 0.0}
    for page in pages:
        for key in ("requests", "tokens", "limiter_errors"):
            out[key] += page[key]
        for limit, n in page["rate_limited"].items():
            out["rate_limited"][limit] = out["rate_limited"].get(limit, 0.0) + n
    return out


def diff_totals(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What the routers counted between two ``sum_totals`` (counters only grow), as ints."""
    limits = set(after["rate_limited"]) | set(before["rate_limited"])
    return {"requests": round(after["requests"] - before["requests"]),
            "tokens": round(after["tokens"] - before["tokens"]),
            "rate_limited": {lim: round(after["rate_limited"].get(lim, 0.0)
                                        - before["rate_limited"].get(lim, 0.0))
                             for lim in sorted(limits)},
            "limiter_errors": round(after["limiter_errors"] - before["limiter_errors"])}


def build_report(admitted: Sequence[Admitted], refused_s: Sequence[float], num_errors: int,
                 start_s: float, end_s: float, step_s: float, tokens_per_minute: int | None,
                 requests_per_minute: int | None, router: dict[str, Any] | None
                 ) -> dict[str, Any]:
    """The report's numbers (see ``tandem.bench.rate_limit``'s module doc).

    Args:
        admitted: every answered request.
        refused_s: when each 429 arrived (epoch seconds).
        num_errors: answers that were neither 200 nor 429 (or failed to arrive).
        start_s / end_s: the load's start and the moment it stopped sending (epoch s).
        step_s: the sliding windows' step (seconds).
        tokens_per_minute / requests_per_minute: the tenant's limits (``None``: none).
        router: ``diff_totals`` over the load, or ``None`` when not read.
    """
    admitted = sorted(admitted, key=lambda a: a.sent_s)
    times = [a.sent_s for a in admitted]
    tokens = [a.num_tokens for a in admitted]
    ones = [1] * len(admitted)
    refused = sorted(refused_s)
    duration_s = end_s - start_s
    token_minutes = fixed_minutes(times, tokens, start_s, end_s)
    request_minutes = fixed_minutes(times, ones, start_s, end_s)
    refused_minutes = fixed_minutes(refused, [1] * len(refused), start_s, end_s)
    minutes = [{"start_s": t["start_s"], "end_s": t["end_s"], "partial": t["partial"],
                "tokens": t["total"], "requests": r["total"], "rate_limited": x["total"]}
               for t, r, x in zip(token_minutes, request_minutes, refused_minutes, strict=True)]
    client = {"requests": len(admitted), "tokens": sum(tokens),
              "prompt_tokens": sum(a.prompt_tokens for a in admitted),
              "completion_tokens": sum(a.completion_tokens for a in admitted),
              "rate_limited": len(refused), "errors": num_errors, "duration_s": duration_s,
              "tokens_per_minute": sum(tokens) * WINDOW_S / duration_s if duration_s else None}
    report: dict[str, Any] = {
        "limits": {"tokens_per_minute": tokens_per_minute,
                   "requests_per_minute": requests_per_minute},
        "client": client,
        "sliding_windows": {
            "window_s": WINDOW_S, "step_s": step_s,
            "tokens": {**sliding_windows(times, tokens, start_s, end_s, step_s).summary(
                tokens_per_minute), "max_any_window": max_any_window(times, tokens)},
            "requests": {**sliding_windows(times, ones, start_s, end_s, step_s).summary(
                requests_per_minute), "max_any_window": max_any_window(times, ones)}},
        "fixed_minutes": minutes,
        "router": router,
    }
    if router is not None:
        report["router_matches_client"] = {
            "requests": router["requests"] == client["requests"],
            "tokens": router["tokens"] == client["tokens"],
            "rate_limited": sum(router["rate_limited"].values()) == client["rate_limited"]}
    return report


def _fmt(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_report(report: dict[str, Any]) -> str:
    """The report as a few lines and tables for a terminal."""
    lim = report["limits"]
    c = report["client"]
    lines = [f"limits: tokens/min {_fmt(lim['tokens_per_minute'])}, requests/min "
             f"{_fmt(lim['requests_per_minute'])}",
             f"client: {c['requests']} admitted requests, {c['tokens']} tokens "
             f"({c['prompt_tokens']} prompt + {c['completion_tokens']} completion) in "
             f"{c['duration_s']:.1f} s = {_fmt(c['tokens_per_minute'], 1)} tokens/min; "
             f"{c['rate_limited']} x 429, {c['errors']} errors"]
    sw = report["sliding_windows"]
    lines.append(f"\nsliding {sw['window_s']:.0f}-s windows, step {sw['step_s']:g} s:")
    lines.append("| quantity | windows | max | mean | over limit | max, any start |")
    lines.append("|---|---|---|---|---|---|")
    for name in ("tokens", "requests"):
        w = sw[name]
        over = (f"{w['num_over_limit']} ({w['share_over_limit']:.1%})"
                if w.get("share_over_limit") is not None else "-")
        lines.append(f"| {name} | {w['num_windows']} | {_fmt(w['max'])} | "
                     f"{_fmt(w['mean'], 1)} | {over} | {w['max_any_window']} |")
    lines.append("\nfixed minutes from the start:")
    lines.append("| minute (s) | tokens | requests | 429s |")
    lines.append("|---|---|---|---|")
    for m in report["fixed_minutes"]:
        tag = " (partial)" if m["partial"] else ""
        lines.append(f"| {m['start_s']:.0f}-{m['end_s']:.0f}{tag} | {m['tokens']} | "
                     f"{m['requests']} | {m['rate_limited']} |")
    r = report["router"]
    if r is not None:
        ok = report["router_matches_client"]
        lines.append(f"\nrouters' /metrics for the tenant: {r['requests']} requests "
                     f"({'=' if ok['requests'] else '!='} client), {r['tokens']} tokens "
                     f"({'=' if ok['tokens'] else '!='} client), 429s {r['rate_limited']} "
                     f"({'=' if ok['rate_limited'] else '!='} client), limiter store errors "
                     f"{r['limiter_errors']}")
    return "\n".join(lines)
