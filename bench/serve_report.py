"""`tandem bench serve`'s report: vLLM's result dict from the requests' measurements (same
keys), the TTFT breakdown from the router's ``timings``, the printed result with ``vllm
bench serve``'s labels, the latency plot and the side-by-side tables of several runs.
(Per-token decode attribution is in the requests' traces: ``--otlp-traces-endpoint``.)"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.bench.serve_client import RequestResult

_BREAKDOWN = {  # label -> timings keys summed (ns)
    "router_queue": ("router_queue_ns",),
    "prefill_queue": ("prefill_queue_ns",),
    "prefill_compute": ("prefill_compute_ns",),
    "kv_handoff": ("kv_publish_ns", "kv_pull_ns"),
    "first_decode_step": ("first_decode_ns",),
}



def _pcts(values_s: list[float], percentiles: list[float], name: str) -> dict[str, float]:
    arr = np.array(values_s or [0.0]) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, percentiles: list[float],
                    slo_ms: dict[str, float]) -> dict[str, Any]:
    """vLLM's result dict (same keys) plus the TTFT breakdown."""
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if (r.ttft * 1000 <= slo_ms.get("ttft", float("inf"))
                and tpot * 1000 <= slo_ms.get("tpot", float("inf"))
                and r.latency * 1000 <= slo_ms.get("e2el", float("inf"))):
            good += 1
    m: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if slo_ms else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        # tandem: completions continued on another instance after one failed mid-stream
        "num_migrations": sum(int(r.timings.get("num_migrations", 0)) for r in ok),
    }
    m.update(_pcts([r.ttft for r in ok], percentiles, "ttft"))
    m.update(_pcts(tpots, percentiles, "tpot"))
    m.update(_pcts([x for r in ok for x in r.itl], percentiles, "itl"))
    m.update(_pcts([r.latency for r in ok], percentiles, "e2el"))
    breakdown = {}
    for label, keys in _BREAKDOWN.items():
        vals = [sum(r.timings.get(k, 0) for k in keys) / 1e9 for r in ok
                if any(k in r.timings for k in keys)]
        if vals:
            breakdown.update(_pcts(vals, percentiles, label))
    m["ttft_breakdown"] = breakdown
    m["input_lens"] = [r.prompt_len for r in results]
    m["output_lens"] = [r.output_tokens for r in results]
    m["ttfts"] = [r.ttft for r in results]
    m["itls"] = [r.itl for r in results]
    m["generated_texts"] = [r.generated_text for r in results]
    m["errors"] = [r.error for r in results]
    return m


def print_cpu_seconds(m: dict[str, Any]) -> None:
    """Each part's CPU seconds over the run (``--profile --launch``)."""
    cpu = m.get("cpu_seconds")
    if cpu:
        for name, sec in cpu.items():
            print(f"{'CPU s, ' + name + ':':<40} {sec:.2f}")
        if m.get("router_tokens_per_cpu_s"):
            print(f"{'router output tok per CPU s:':<40} {m['router_tokens_per_cpu_s']:.0f}")


def print_result(m: dict[str, Any], percentiles: list[float], request_rate: float) -> None:
    """Print with ``vllm bench serve``'s labels."""
    w = 50

    def row(label: str, value: Any, fmt: str = "<10.2f") -> None:
        print(f"{label:<40} {value:{fmt}}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    row("Successful requests:", m["completed"], "<10")
    row("Failed requests:", m["failed"], "<10")
    row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "<10")
    row("Total generated tokens:", m["total_output_tokens"], "<10")
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    sections = [("ttft", "Time to First Token", "TTFT"),
                ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                ("itl", "Inter-token Latency", "ITL"),
                ("e2el", "End-to-end Latency", "E2EL")]
    for key, title, short in sections:
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", m[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"])
    if m["ttft_breakdown"]:
        print("{s:{c}^{n}}".format(s="TTFT breakdown (tandem)", n=w, c="-"))
        for label in _BREAKDOWN:
            if f"mean_{label}_ms" in m["ttft_breakdown"]:
                b = m["ttft_breakdown"]
                print(f"{label + ' (ms) mean/median/p99:':<40} {b[f'mean_{label}_ms']:.2f} / "
                      f"{b[f'median_{label}_ms']:.2f} / {b.get(f'p99_{label}_ms', float('nan')):.2f}")
    print("=" * w)


def plot(results_by_rate: list[dict[str, Any]], path: str, percentiles: list[float]) -> None:
    """PNG of TTFT / TPOT / ITL / E2EL percentiles (ms) over the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.get("label") for r in results_by_rate))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, key in zip(axes, ("ttft", "tpot", "itl", "e2el"), strict=True):
        for color, label in enumerate(labels):
            runs = [r for r in results_by_rate if r.get("label") == label]
            rates = [r["request_rate"] for r in runs]
            stats = ["median", *[f"p{p:g}" for p in percentiles if p != 50]]
            for style, stat in zip(("-", "--", ":", "-."), stats, strict=False):
                name = stat if label is None else f"{label} {stat}"
                ax.plot(rates, [r[f"{stat}_{key}_ms"] for r in runs], marker="o",
                        linestyle=style, color=f"C{color}", label=name)
        ax.set_title(key.upper())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_fault_comparison(results: list[dict[str, Any]], percentiles: list[float]) -> None:
    """One row per run: goodput (or throughput without an SLO), p99 TTFT / ITL, failures."""
    p = max(percentiles)
    print(f"{'run':<22} {'req/s':>8} {'goodput':>8} {'out tok/s':>10} "
          f"{f'p{p:g} TTFT ms':>13} {f'p{p:g} ITL ms':>12} {'failed':>7} {'migrated':>9}")
    for m in results:
        good = m["request_goodput"]
        print(f"{m['label']!s:<22} {m['request_throughput']:>8.2f} "
              f"{'-' if good is None else f'{good:.2f}':>8} {m['output_throughput']:>10.1f} "
              f"{m[f'p{p:g}_ttft_ms']:>13.1f} {m[f'p{p:g}_itl_ms']:>12.1f} "
              f"{m['failed']:>7} {m['num_migrations']:>9}")


def side_by_side(results: list[dict[str, Any]]) -> str:
    """A markdown table of the runs (one row per label and rate): throughput, median
    TTFT / TPOT / ITL, and for speculative runs the acceptance rate and mean acceptance
    length (summed over the engines)."""
    lines = ["| run | rate (req/s) | output tok/s | median TTFT ms | median TPOT ms | "
             "median ITL ms | acceptance rate | mean acceptance length |",
             "|---|---|---|---|---|---|---|---|"]
    for m in results:
        rate, accept, length = "", "", ""
        if "request_rate" in m:
            rate = f"{m['request_rate']:g}"
        spec = m.get("speculative")
        if spec:
            drafts = sum(c.get("spec_decode_num_drafts", 0.0) for c in spec.values())
            tokens = sum(c.get("spec_decode_num_draft_tokens", 0.0) for c in spec.values())
            acc = sum(c.get("spec_decode_num_accepted_tokens", 0.0) for c in spec.values())
            accept = f"{acc / tokens:.3f}" if tokens else "0"
            length = f"{1 + acc / drafts:.2f}" if drafts else "1"
        cells = [f"{m[k]:.1f}" if k in m else "" for k in
                 ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")]
        lines.append(f"| {m.get('label')} | {rate} | " + " | ".join(cells)
                     + f" | {accept} | {length} |")
    return "\n".join(lines)


def doors_table(results: list[dict[str, Any]], base_door: str) -> str:
    """A markdown table of one run's doors (``--endpoint-type`` several): one row per rate
    and door, in the order run, with output tokens, output tok/s and its ratio to
    ``base_door``'s at the same rate (the same position in ``--request-rate``, which may
    repeat a rate), median TTFT / TPOT / ITL (ms) and failed requests."""
    lines = ["| round | rate (req/s) | door | output tokens | output tok/s | "
             f"vs {base_door} | median TTFT ms | median TPOT ms | median ITL ms | failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    num_doors = len({m["endpoint_type"] for m in results})
    for k, m in enumerate(results):
        rnd = k // num_doors
        base = next(b["output_throughput"] for b in results[rnd * num_doors:][:num_doors]
                    if b["endpoint_type"] == base_door)
        ratio = f"{m['output_throughput'] / base:.3f}" if base else "-"
        lines.append(f"| {rnd} | {m['request_rate']:g} | {m['endpoint_type']} | "
                     f"{m['total_output_tokens']} | {m['output_throughput']:.1f} | {ratio} | "
                     f"{m['median_ttft_ms']:.1f} | {m['median_tpot_ms']:.1f} | "
                     f"{m['median_itl_ms']:.1f} | {m['failed']} |")
    return "\n".join(lines)
