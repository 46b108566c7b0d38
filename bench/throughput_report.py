"""What `tandem bench throughput` reports beside the rates: the machine, each variant
run (structured outputs, speculative decoding, deterministic kernels, TP/PP) against
plain tandem, and tandem against the other backends."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from typing import Any


def spec_stats(llm: Any) -> dict[str, Any]:
    """The engine's cumulative speculative-decoding counters (``SpecDecodeStats``)."""
    st = llm.llm_engine.engine_core.get_stats().spec_decode
    return {
        "num_drafts": st.num_drafts,
        "num_draft_tokens": st.num_draft_tokens,
        "num_accepted_tokens": st.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(st.num_accepted_tokens_per_pos),
    }


def acceptance(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """Acceptance over the timed passes (``end - start`` of ``spec_stats``): rate =
    accepted / draft tokens; mean acceptance length = tokens per verification
    (accepted + 1, vLLM's definition)."""
    d = {k: end[k] - start[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["num_accepted_tokens_per_pos"] = [
        b - a for a, b in zip(start["num_accepted_tokens_per_pos"],
                              end["num_accepted_tokens_per_pos"], strict=True)
    ]
    d["acceptance_rate"] = d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1)
    d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / max(d["num_drafts"], 1)
    return d


#: The ``lscpu`` flags that decide which kernels run (recorded with the numbers).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


def variant_ratio(variant: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``ratio``: ``variant``'s output tokens/s over ``base``'s; ``paired_ratios``: the
    same per pass (pass ``i`` of both ran back to back on the same prompts)."""
    return {
        "ratio": variant["output_tokens_per_s"] / base["output_tokens_per_s"],
        "paired_ratios": [
            (variant["num_output_tokens"] / vs) / (base["num_output_tokens"] / bs)
            for vs, bs in zip(variant["runs_s"], base["runs_s"], strict=True)
        ],
    }


def ratio_line(label: str, report: dict[str, Any]) -> str:
    """``"<label>: 1.23x output tokens/s"``, with the per-pass ratios when several."""
    line = f"{label}: {report['ratio']:.2f}x output tokens/s"
    if len(report["paired_ratios"]) > 1:
        line += " (per pass: " + ", ".join(f"{x:.2f}x" for x in report["paired_ratios"]) + ")"
    return line


def num_other_outputs(outputs: dict[str, Any], a: str, b: str) -> int:
    """Requests whose tokens differ between runners ``a`` and ``b`` (per pass, per
    request token ids in ``outputs``)."""
    return sum(x != y for pa, pb in zip(outputs[a], outputs[b], strict=True)
               for x, y in zip(pa, pb, strict=True))


def baseline_ratios(results: dict[str, dict[str, Any]]
                    ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Print and return tandem's output tokens/s over each other backend's (``tandem/<name>``
    keys), overall and per pass."""
    ratios: dict[str, float] = {}
    paired: dict[str, list[float]] = {}
    if "tandem" not in results:
        return ratios, paired
    for name, r in results.items():
        if name == "tandem" or name.startswith("tandem+"):
            continue
        key = f"tandem/{name}"
        report = variant_ratio(results["tandem"], r)
        ratios[key], paired[key] = report["ratio"], report["paired_ratios"]
        print(ratio_line(f"tandem / {name}", report))
    return ratios, paired


def structured_report(name: str, c: dict[str, Any], t: dict[str, Any]) -> dict[str, Any]:
    """Print and return the structured-output run ``name`` (``c``) against tandem (``t``),
    with the grammar backend's setup and compile times."""
    report = {
        **variant_ratio(c, t),
        "grammar_backend_setup_s": c["grammar_backend_setup_s"],
        "grammar_compile_first_s": c["grammar_compile_first_s"],
        "grammar_compile_cached_s": c["grammar_compile_cached_s"],
    }
    print(ratio_line(f"{name} / tandem", report))
    print(
        f"grammar: backend setup {report['grammar_backend_setup_s'] * 1e3:.1f} ms, "
        f"first compile {report['grammar_compile_first_s'] * 1e3:.2f} ms, "
        f"cached {report['grammar_compile_cached_s'] * 1e3:.3f} ms"
    )
    return report


def speculative_report(c: dict[str, Any], t: dict[str, Any]) -> dict[str, Any]:
    """Print and return tandem+spec (``c``) against tandem (``t``), with its acceptance."""
    acc = c["spec_decode"]
    report = {**variant_ratio(c, t), **acc}
    print(ratio_line("tandem+spec / tandem", report))
    print(
        f"speculative decoding: acceptance rate {acc['acceptance_rate']:.3f}, "
        f"mean acceptance length {acc['mean_acceptance_length']:.2f} "
        f"({acc['num_accepted_tokens']} of {acc['num_draft_tokens']} draft tokens "
        f"in {acc['num_drafts']} drafts; accepted per position "
        f"{acc['num_accepted_tokens_per_pos']})"
    )
    return report


def deterministic_report(d: dict[str, Any], t: dict[str, Any], outputs: dict[str, Any],
                         num_requests: int) -> dict[str, Any]:
    """Print and return tandem+det (``d``) against tandem (``t``), with how many of the
    ``num_requests`` requests got other greedy tokens."""
    # NOTE: tandem's own kernels differ from the batch-invariant ones in summation
    # order, so a few requests may differ (a near-tie); counted, not asserted.
    report = {**variant_ratio(d, t),
              "requests_with_other_tokens": num_other_outputs(outputs, "tandem", "tandem+det")}
    print(ratio_line("tandem+det / tandem", report))
    print(
        f"deterministic: {report['requests_with_other_tokens']} of "
        f"{num_requests} requests got other greedy tokens than tandem's"
    )
    return report


def parallel_report(par: dict[str, Any], one: dict[str, Any], args: argparse.Namespace,
                    outputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Print and return tandem+par against tandem: the throughput ratio (overall and per
    pass) and what the workers' collectives cost (``collectives``: per rank, seconds and
    calls of all-reduce / gather / send / recv over the whole run, warm-up included;
    ``num_steps``: the engine steps that ran a batch over the same span, and
    ``ms_per_step``: per rank and op, milliseconds of collectives per such step).
    With ``outputs`` (runner name -> per pass, per request token ids): how many
    requests got other tokens at TP/PP than in one process (``requests_with_other_tokens``;
    counted, not asserted: the sharded sums reduce in another order)."""
    steps = int(par.get("num_steps", 0))
    report: dict[str, Any] = {
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        **variant_ratio(par, one),
        "collectives": par.get("collectives", []),
        "num_steps": steps,
        "ms_per_step": [
            {op: v["seconds"] * 1e3 / steps for op, v in stats.items() if v["calls"]}
            for stats in par.get("collectives", [])
        ] if steps else [],
        "max_concurrent_batches": par.get("max_concurrent_batches"),
        "max_num_batches_in_flight": par.get("max_num_batches_in_flight"),
    }
    if outputs and outputs.get("tandem") and outputs.get("tandem+par"):
        report["requests_with_other_tokens"] = num_other_outputs(outputs, "tandem",
                                                                 "tandem+par")
    sizes = (f"TP={args.tensor_parallel_size} PP={args.pipeline_parallel_size} "
             f"batches in flight<={report['max_concurrent_batches']}")
    print(ratio_line(f"tandem+par ({sizes}) / tandem", report))
    for rank, stats in enumerate(report["collectives"]):
        parts = [f"{op} {v['calls']} calls {v['seconds'] * 1e3:.0f} ms"
                 + (f" ({v['seconds'] * 1e3 / steps:.2f} ms/step)" if steps else "")
                 for op, v in sorted(stats.items()) if v["calls"]]
        print(f"  rank {rank}: " + (", ".join(parts) or "no collectives"))
    if steps:
        print(f"  {steps} engine steps (warm-up included, as the collectives)")
    if "requests_with_other_tokens" in report:
        print(f"  {report['requests_with_other_tokens']} of {args.num_prompts * args.repeat} "
              "requests got other tokens than tandem's")
    return report


def machine_info() -> dict[str, Any]:
    """CPU model and count, platform, torch version: recorded beside the numbers."""
    import torch

    cpu = platform.processor() or "unknown"
    flags: list[str] = []
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                have = set(line.split(":", 1)[1].split())
                flags = [f for f in _ISA_FLAGS if f in have]
    except (OSError, subprocess.CalledProcessError):
        pass  # lscpu missing: keep platform.processor()
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "num_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
