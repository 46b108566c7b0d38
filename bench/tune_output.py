"""What `tandem tune` hands back: the `tandem up` command line and Helm values of a
candidate, the frontier table, the plot and the JSON report.

The `tandem up` arguments built here are also what the tuner starts each candidate with
(``tandem.up.config_from_args`` parses them), so the printed command is the one measured.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from tandem.bench.tune_search import RatePoint, SearchResult, summary
from tandem.bench.tune_space import Candidate


def up_args(c: Candidate, model: str | None, engine_args: list[str]) -> list[str]:
    """`tandem up` arguments (without the program name) that start ``c``.

    Args:
        model: ``--model`` (None: the default model).
        engine_args: further engine flags, each one argv element (``--dtype=bfloat16``).
    """
    t = c.topology
    argv = (["--colocated", "--replicas", str(t.replicas)] if t.colocated
            else ["--prefill", str(t.prefill), "--decode", str(t.decode)])
    if t.cpus_per_engine:
        argv += ["--cpus-per-engine", str(t.cpus_per_engine)]
    if model:
        argv += ["--model", model]
    argv += [f"--engine-arg={a}" for a in [*engine_args, *c.knobs.engine_args()]]
    return argv


def up_command(c: Candidate, model: str | None, engine_args: list[str]) -> str:
    """The ready `tandem up ...` command line of ``c`` (shell-quoted)."""
    return shlex.join(["tandem", "up", *up_args(c, model, engine_args)])


def _flag_value(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """(value of ``flag`` in ``args`` as ``--f=V`` or ``--f V``, the other args)."""
    value, rest, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a == flag and i + 1 < len(args):
            value, i = args[i + 1], i + 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return value, rest


def helm_values(c: Candidate, engine_args: list[str]) -> dict[str, Any]:
    """Values for the Helm chart (helm/tandem) that deploy ``c`` on CPU nodes.

    Each engine pod gets the knobs as ``<role>.scheduler`` (chunk size in ``extraArgs``,
    the chart has no key for it), ``gpus: 0`` and ``device: cpu``, and, when ``c``
    pins engines, a CPU request of that many cores. ``--dtype`` among ``engine_args``
    becomes ``model.dtype``; other engine flags go to ``extraArgs``.

    Raises:
        ValueError: ``c`` is colocated (the chart deploys prefill and decode roles only).
    """
    t, k = c.topology, c.knobs
    if t.colocated:
        raise ValueError("the Helm chart deploys prefill and decode pods only; a colocated "
                         "configuration has no values")
    dtype, extra = _flag_value(engine_args, "--dtype")
    if k.long_prefill_token_threshold:
        extra = [*extra, f"--long-prefill-token-threshold={k.long_prefill_token_threshold}"]
    values: dict[str, Any] = {}
    if dtype is not None:
        values["model"] = {"dtype": dtype}
    for role, replicas in (("prefill", t.prefill), ("decode", t.decode)):
        v: dict[str, Any] = {
            "replicas": replicas, "gpus": 0, "device": "cpu",
            "scheduler": {"maxNumBatchedTokens": k.max_num_batched_tokens,
                          "maxNumSeqs": k.max_num_seqs},
        }
        if extra:
            v["extraArgs"] = list(extra)
        if t.cpus_per_engine:
            v["resources"] = {"requests": {"cpu": str(t.cpus_per_engine)}}
        values[role] = v
    return values


def to_yaml(values: dict[str, Any], indent: int = 0) -> str:
    """Block YAML of nested dicts whose leaves are JSON scalars or lists (JSON's flow
    syntax is YAML)."""
    lines = []
    for key, v in values.items():
        if isinstance(v, dict):
            lines.append(f"{' ' * indent}{key}:")
            lines.append(to_yaml(v, indent + 2))
        else:
            lines.append(f"{' ' * indent}{key}: {json.dumps(v)}")
    return "\n".join(lines)


def helm_snippet(result: SearchResult, engine_args: list[str]) -> str:
    """Helm values YAML of the best candidate, or, when that one is colocated, of the best
    disaggregated candidate that met the SLO (with a comment saying so); empty when
    there is none."""
    best = result.best()
    if best is None:
        return ""
    head = f"# tandem tune: {best.candidate.label}\n"
    if best.candidate.topology.colocated:
        disagg = [r for r in result.ranked()
                  if not r.candidate.topology.colocated and r.score(result.slo) > 0]
        if not disagg:
            return ("# tandem tune: the best configuration is colocated, which the chart "
                    "does not deploy, and no disaggregated one met the SLO\n")
        head = ("# tandem tune: the best configuration is colocated, which the chart does "
                "not deploy;\n# the best disaggregated one "
                f"({disagg[0].score(result.slo):.3f} req/s goodput): "
                f"{disagg[0].candidate.label}\n")
        best = disagg[0]
    return head + to_yaml(helm_values(best.candidate, engine_args)) + "\n"


def frontier_table(result: SearchResult) -> str:
    """Markdown table: one row per candidate, best first, with its best load meeting the
    SLO (rate, goodput, TTFT / TPOT at the SLO's percentile, output tok/s) and how many
    rates were run."""
    slo = result.slo
    p = f"p{slo.percentile:g}"
    lines = [f"| # | configuration | goodput (req/s) | at rate (req/s) | {p} TTFT ms | "
             f"{p} TPOT ms | output tok/s | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result.ranked(), 1):
        b = r.best(slo)
        name = r.candidate.label + (" **(default)**" if r.candidate == result.default else "")
        if b is None:
            why = r.error or "SLO not met"
            lines.append(f"| {i} | {name} | 0 | - | - | - | - | {len(r.points)} ({why}) |")
            continue
        lines.append(f"| {i} | {name} | {b.goodput:.3f} | {b.rate:.3g} | {b.ttft_ms:.0f} | "
                     f"{b.tpot_ms:.1f} | {b.output_throughput:.1f} | {len(r.points)} |")
    return "\n".join(lines)


def _said(p: RatePoint, slo: Any) -> str:
    return f"{p.goodput:.3f} req/s ({'SLO met' if p.meets(slo) else 'SLO broken'})"


def verdict(result: SearchResult) -> str:
    """The best candidate's goodput against the default's, as measured in the search,
    and, when the search re-measured both at the end, a second line with those runs."""
    slo = result.slo
    best, default = result.best(), result.result(result.default)
    if best is None:
        return "no configuration met the SLO: loosen it or lower --start-rate"
    base = default.score(slo) if default is not None else 0.0
    gain = (f"{best.score(slo) / base:.2f}x the default's {base:.3f} req/s" if base > 0
            else "the default met the SLO at no rate tried")
    line = f"best: {best.candidate.label}: goodput {best.score(slo):.3f} req/s, {gain}"
    again = [r.points[0] for r in result.confirmation if r.points]
    if len(again) == 2:
        d, b = again
        line += (f"\nre-measured one after the other at {b.rate:.3g} req/s: default "
                 f"{_said(d, slo)}, best {_said(b, slo)}")
    return line


def report(result: SearchResult, model: str | None, engine_args: list[str],
           settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON report: settings, SLO, every candidate (``summary``), the best and the
    default, and the best one's `tandem up` command and Helm values."""
    slo = result.slo
    best, default = result.best(), result.result(result.default)
    return {
        "settings": settings,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms,
                "percentile": slo.percentile},
        "stopped": result.stopped,
        "elapsed_s": result.elapsed_s,
        "best": None if best is None else summary(best, slo),
        "default": None if default is None else summary(default, slo),
        "up_command": None if best is None else up_command(best.candidate, model, engine_args),
        "helm_values": helm_snippet(result, engine_args),
        "candidates": [summary(r, slo) for r in result.results],
        "confirmation": [summary(r, slo) for r in result.confirmation],
    }


def plot(result: SearchResult, path: str) -> None:
    """PNG: goodput over offered rate per candidate (filled markers: the SLO held;
    hollow: broken), and the TTFT / TPOT at the SLO's percentile with the bounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    slo = result.slo
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    best = result.best()
    for i, r in enumerate(result.results):
        pts = sorted(r.points, key=lambda p: p.rate)
        if not pts:
            continue
        emphasis = r is best or r.candidate == result.default
        style = {"color": f"C{i % 10}", "linewidth": 2.5 if emphasis else 1.0,
                 "alpha": 1.0 if emphasis else 0.5}
        label = r.candidate.label + (" (default)" if r.candidate == result.default else "")
        rates = [p.rate for p in pts]
        for ax, ys in zip(axes, ([p.goodput for p in pts], [p.ttft_ms for p in pts],
                                 [p.tpot_ms for p in pts]), strict=True):
            ax.plot(rates, ys, **style, label=label if ax is axes[0] else None)
            for p, y in zip(pts, ys, strict=True):
                ax.plot([p.rate], [y], marker="o", color=style["color"],
                        fillstyle="full" if p.meets(slo) else "none")
    bounds = slo.bounds_ms()
    for ax, key, title in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        if key in bounds:
            ax.axhline(bounds[key], color="red", linestyle="--", label="SLO")
            ax.legend()
        ax.set_title(f"p{slo.percentile:g} {title} (ms)")
    axes[0].set_title("goodput (req/s meeting the SLO)")
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
