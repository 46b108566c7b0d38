"""`tandem bench serve`: online serving load test against a running router (HTTP, SSE).

Mirrors ``vllm bench serve``: the same flags (``--request-rate``, ``--burstiness``,
``--num-prompts``, ``--random-input-len``/``--random-output-len``/``--random-range-ratio``,
``--max-concurrency``, ``--goodput``, ``--percentile-metrics``, ``--metric-percentiles``,
``--save-result``), the same printed labels and the same JSON keys, so results compare
directly. Arrivals are a gamma process (Poisson for ``--burstiness 1``) as in vLLM.

Beyond vLLM: several request rates in one run (``--request-rate 1 2 4``), ``--slo
ttft=MS,tpot=MS`` for goodput, a mix of prompt lengths (``--input-len-mix 128:0.8,2048:0.2``),
each request's TTFT broken down from the router's ``timings`` (router queue, prefill queue,
prefill compute, KV handoff = publish + pull, first decode step), ``--json`` to print the
result as JSON and ``--plot`` for a PNG of latency percentiles over request rate.

``--fault PART@SECONDS`` (with ``--launch``; bench/faults.py) runs the load twice on each
launched stack, without faults and then with the schedule (parts killed, restarted as
`tandem up` does), and prints goodput, p99 TTFT / ITL, failed and migrated requests of
both side by side. ``--launch-prefill`` / ``--launch-decode`` size a disaggregated stack.

``--speculative-config JSON`` (with ``--launch``) runs each launched stack twice, without
and then with speculative decoding on its decode (or colocated) engines (labels ``disagg``
and ``disagg+spec``), adds the engines' acceptance rate and mean acceptance length (their
``tandem:spec_decode_*`` counters) to the result and prints the runs side by side.

Prompts are random token ids sent as ``prompt: [ids]`` so input lengths are exact.
``--dataset-name multi-turn`` runs chat conversations instead (bench/multiturn.py: a
shared system prompt, ``--multi-turn-turns`` turns each) and reports TTFT per turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

_BREAKDOWN = {  # label -> timings keys summed (ns)
    "router_queue": ("router_queue_ns",),
    "prefill_queue": ("prefill_queue_ns",),
    "prefill_compute": ("prefill_compute_ns",),
    "kv_handoff": ("kv_publish_ns", "kv_pull_ns"),
    "first_decode_step": ("first_decode_ns",),
}

# The decode stream's per-token attribution, in a token's order: label -> (timings key
# summed over the request's tokens, the timings key counting what it is divided by).
_DECODE_STAGES = {
    "engine_step": ("decode_engine_ns", "decode_engine_outputs"),
    "engine_output": ("decode_output_ns", "decode_tokens"),
    "grpc": ("decode_grpc_ns", "decode_tokens"),
    "detokenize": ("decode_detokenize_ns", "decode_tokens"),
    "sse_write": ("decode_sse_ns", "decode_tokens"),
}


@dataclass
class RequestResult:
    """One request's measurements (seconds)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    timings: dict[str, Any] = field(default_factory=dict)


def sample_prompts(n: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int, mix: list[tuple[int, float]] | None = None
                   ) -> list[tuple[list[int], int]]:
    """``n`` random prompts (token ids) with their output lengths, as vLLM's random dataset.

    Lengths are uniform in ``[len * (1 - r), len * (1 + r)]``; with ``mix`` the input length
    is first drawn from ``(length, weight)`` pairs.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = input_len
        if mix:
            base = rng.choices([m[0] for m in mix], weights=[m[1] for m in mix])[0]
        lo, hi = max(1, int(base * (1 - range_ratio))), max(1, int(base * (1 + range_ratio)))
        olo, ohi = max(1, int(output_len * (1 - range_ratio))), max(1, int(
            output_len * (1 + range_ratio)))
        # Ids from 1000 up avoid special and control tokens of common vocabularies.
        ids = [rng.randrange(1000, vocab_size) for _ in range(rng.randint(lo, hi))]
        out.append((ids, rng.randint(olo, ohi)))
    return out


def http_session() -> Any:
    """The load generator's HTTP client: an ``aiohttp.ClientSession`` (vllm bench serve's
    client) with no connection limit, a 1 h timeout and room for long SSE lines (a last
    chunk with ``timings``). aiohttp, not httpx: the client shares the machine with the
    servers it measures, and httpx spent several times aiohttp's CPU per streamed line,
    which showed as inter-token jitter of the client's own (docs/benchmarks.md, "The
    router's own ceiling")."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=3600.0),
                                 read_bufsize=1 << 20)


async def sse_events(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON payload of each ``data:`` event of a streamed OpenAI response (an
    ``aiohttp.ClientResponse`` from :func:`http_session`), up to ``data: [DONE]``.

    Raises:
        json.JSONDecodeError: an event whose payload is not JSON.
    """
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def _one(client: Any, url: str, model: str, prompt: list[int], max_tokens: int,
               ignore_eos: bool, extra: dict[str, Any] | None = None,
               temperature: float = 0.0) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True, "ignore_eos": ignore_eos, "stream_options": {"include_usage": True},
            **(extra or {})}
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return res
            async for data in sse_events(resp):
                if "error" in data:
                    res.error = str(data["error"].get("message"))
                    return res
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if data.get("timings"):
                    res.timings = data["timings"]
                for choice in data.get("choices") or ():
                    now = time.perf_counter()
                    if not res.ttft:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.generated_text += choice.get("text") or ""
        res.latency = time.perf_counter() - start
        res.success = res.ttft > 0
    except Exception as exc:  # noqa: BLE001 - a failed request is a measurement, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_rate(url: str, model: str, prompts: list[tuple[list[int], int]],
                   request_rate: float, burstiness: float, max_concurrency: int | None,
                   ignore_eos: bool, seed: int, structured: str | None = None,
                   temperature: float = 0.0) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` with gamma-distributed gaps at ``request_rate`` req/s (inf: at once),
    each sampled at ``temperature`` (0: greedy).

    ``structured="json"``: every request carries vLLM's ``structured_outputs`` with the JSON
    schema of ``tandem bench throughput --structured json`` (no output of its
    ``max_tokens`` completes it, so constrained and unconstrained runs generate the same
    token counts).
    """
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with http_session() as client:
        def extra(o: int) -> dict[str, Any] | None:
            if structured is None:
                return None
            from tandem.bench.throughput import structured_schema

            return {"structured_outputs": {"json": structured_schema(o)}}

        async def guarded(p: list[int], o: int) -> RequestResult:
            if sem is None:
                return await _one(client, url, model, p, o, ignore_eos, extra(o), temperature)
            async with sem:
                return await _one(client, url, model, p, o, ignore_eos, extra(o), temperature)

        tasks = []
        start = time.perf_counter()
        for p, o in prompts:
            tasks.append(asyncio.create_task(guarded(p, o)))
            if request_rate != float("inf"):
                theta = 1.0 / (request_rate * burstiness)
                await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


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
    m["decode_breakdown"] = decode_breakdown(ok, percentiles)
    m["input_lens"] = [r.prompt_len for r in results]
    m["output_lens"] = [r.output_tokens for r in results]
    m["ttfts"] = [r.ttft for r in results]
    m["itls"] = [r.itl for r in results]
    m["generated_texts"] = [r.generated_text for r in results]
    m["errors"] = [r.error for r in results]
    return m


def decode_breakdown(results: list[RequestResult], percentiles: list[float]
                     ) -> dict[str, float]:
    """Per-token decode attribution from the router's ``timings``: for each stage of
    ``_DECODE_STAGES``, the per-request mean per token (ms), as mean / median /
    percentiles over the requests (keys ``mean_<stage>_ms`` ...).

    ``engine_step`` is the engine's time per step (first to last output's step end over
    the steps between); the other stages are latencies a token spends on its way from
    the engine step that made it to the client's socket. ``sse_write`` excludes each
    request's last chunk (it carries the timings), hence its divisor is one token less.
    """
    out: dict[str, float] = {}
    for label, (key, count_key) in _DECODE_STAGES.items():
        vals = []
        for r in results:
            total, count = r.timings.get(key), r.timings.get(count_key)
            if total is None or not count:
                continue
            # n outputs span n - 1 steps; the last chunk's SSE write is not counted
            count -= 1 if label in ("engine_step", "sse_write") else 0
            if count > 0:
                vals.append(total / count / 1e9)
        if vals:
            out.update(_pcts(vals, percentiles, label))
    return out


def print_decode_breakdown(m: dict[str, Any]) -> None:
    """The per-token attribution (``--profile``): each stage's mean / median / p99 per
    token in ms, and the path's share of the client's mean inter-token latency."""
    b = m.get("decode_breakdown") or {}
    w = 50
    print("{s:{c}^{n}}".format(s="Per-token decode attribution (tandem)", n=w, c="-"))
    if not b:
        print("(no decode timings in the responses)")
        return
    path = 0.0
    for label in _DECODE_STAGES:
        if f"mean_{label}_ms" not in b:
            continue
        if label != "engine_step":
            path += b[f"mean_{label}_ms"]
        print(f"{label + ' (ms/token) mean/median/p99:':<40} {b[f'mean_{label}_ms']:.3f} / "
              f"{b[f'median_{label}_ms']:.3f} / {b.get(f'p99_{label}_ms', float('nan')):.3f}")
    print(f"{'engine step -> SSE written (ms/token):':<40} {path:.3f}")
    if "mean_engine_step_ms" in b and m.get("mean_itl_ms"):
        print(f"{'client mean ITL / engine step:':<40} "
              f"{m['mean_itl_ms']:.2f} / {b['mean_engine_step_ms']:.2f} ms")
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


def parse_slo(items: list[str], sep: str) -> dict[str, float]:
    """``ttft=500,tpot=50`` or vLLM's ``ttft:500 tpot:50`` -> {metric: ms}.

    Args:
        items: the flag values, each one or more ``NAME<sep>MS`` joined by commas.
        sep: ``=`` (``--slo``) or ``:`` (``--goodput``).

    Raises:
        ValueError: a part that is not ``ttft``, ``tpot`` or ``e2el`` with a value.
    """
    out: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            name, _, value = part.partition(sep)
            name = name.strip().lower()
            if name not in ("ttft", "tpot", "e2el") or not value:
                raise ValueError(f"SLO must look like ttft{sep}MS,tpot{sep}MS, got {part!r}")
            out[name] = float(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                   help="router base URL")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the router's first)")
    p.add_argument("--dataset-name", default="random", choices=["random", "multi-turn"],
                   help="random: token-id prompts; multi-turn: chat conversations whose "
                        "turns resend the history (bench/multiturn.py)")
    p.add_argument("--multi-turn-conversations", type=int, default=16,
                   help="multi-turn: conversations (they start at --request-rate)")
    p.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: turns each")
    p.add_argument("--multi-turn-system-len", type=int, default=1000,
                   help="multi-turn: tokens of the system prompt all conversations share")
    p.add_argument("--multi-turn-user-len", type=int, default=64,
                   help="multi-turn: tokens of each user message")
    p.add_argument("--multi-turn-answer-len", type=int, default=64,
                   help="multi-turn: tokens of each answer (ignore_eos)")
    p.add_argument("--multi-turn-skip-special-tokens", action="store_true",
                   help="multi-turn: drop special tokens from the answers' text (the API's "
                        "default); by default they stay, so the next turn's history "
                        "re-tokenises to the ids generated even when an answer runs past "
                        "its end of turn")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--input-len-mix", default=None,
                   help="LEN:WEIGHT,... draw each input length from these (e.g. 64:0.8,2048:0.2)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s; several values run one after another")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy); "
                        "vllm bench serve sends none, so a server samples at its own "
                        "default: 1.0 for tandem and vLLM unless the model's "
                        "generation_config.json sets one")
    p.add_argument("--structured", choices=["json"], default=None,
                   help="constrain every request by a JSON schema (structured_outputs.json) "
                        "that no output of its length completes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="+", default=[], help="vLLM form: ttft:MS tpot:MS")
    p.add_argument("--slo", default="", help="ttft=MS,tpot=MS (same as --goodput)")
    p.add_argument("--tokenizer", default=None,
                   help="model path whose tokenizer sizes the vocabulary (default model if unset)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: from the model's tokenizer)")
    p.add_argument("--json", default=None, nargs="?", const="-",
                   help="write the result JSON to this file ('-' or no value: stdout)")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", default=None,
                   help="PNG of latency percentiles over request rate (multi-turn: median "
                        "TTFT and cached share per turn, per stack)")
    p.add_argument("--label", default=None, help="a name for this run (in the JSON)")
    p.add_argument("--launch", action="append", default=[],
                   choices=["disagg", "disagg-no-reuse", "colocated"],
                   help="start this stack (tandem up) for the run instead of using --url; "
                        "repeat to compare: --launch disagg --launch colocated; "
                        "disagg-no-reuse: engines neither load prompts' stored prefixes nor "
                        "publish finished outputs (the store only hands prompts from "
                        "prefill to decode)")
    p.add_argument("--launch-model", default=None, help="model for --launch")
    p.add_argument("--launch-engine-arg", action="append", default=[],
                   help="extra engine flag for --launch stacks, e.g. --launch-engine-arg="
                        "--max-num-batched-tokens=512")
    p.add_argument("--launch-router-arg", action="append", default=[],
                   help="extra flag for the launched router (repeatable), e.g. "
                        "--launch-router-arg=--disagg-min-uncached-tokens=64")
    p.add_argument("--launch-prefill", type=int, default=1,
                   help="prefill instances of a --launch disagg stack")
    p.add_argument("--launch-decode", type=int, default=1,
                   help="decode instances of a --launch disagg stack")
    p.add_argument("--fault", action="append", default=[], metavar="PART@SECONDS",
                   help="with --launch: also run the load with PART (decode-0, prefill-1, "
                        "kvstore, redis) killed SECONDS into it, restarted as tandem up "
                        "does, and compare (repeatable)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="with --launch: run each stack without and with this speculative "
                        "decoding config on its decode engines, side by side")
    p.add_argument("--profile", action="store_true",
                   help="print the per-token decode attribution (engine step, engine "
                        "output, gRPC, detokenize, SSE write; from the router's timings); "
                        "with --launch also each part's CPU seconds and, when py-spy is "
                        "installed, a py-spy flame graph of the router and engines")
    p.add_argument("--profile-dir", default=".",
                   help="where --profile --launch writes the py-spy flame graphs")
    p.add_argument("--launch-disagg-cpus", type=int, default=0,
                   help="CPUs pinned to each of the prefill and decode engines (--launch "
                        "disagg); 0: unpinned, taking turns on the shared cores, as `tandem "
                        "up` starts them")
    return p


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process (by name) has used so far (0: gone)."""
    import psutil

    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


def model_and_vocab(base: str, model: str | None, tokenizer: str | None,
                    vocab_size: int | None) -> tuple[str, int]:
    """The model to request (``model``, else the router at ``base`` serves first) and the
    vocabulary size random prompts draw from (``vocab_size``, else ``tokenizer``'s, the
    default model's when ``None``).

    Raises:
        httpx.HTTPError: the router's ``/v1/models`` cannot be read.
    """
    import httpx

    served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    model = model or served[0]["id"]
    if vocab_size is None:
        from tandem.engine.model_files import load_tokenizer

        vocab_size = len(load_tokenizer(tokenizer))
    return model, vocab_size


def _run_all(args: argparse.Namespace, url: str, percentiles: list[float],
             slo: dict[str, float], mix: list[tuple[int, float]] | None,
             label: str | None, pids: dict[str, int] | None = None
             ) -> tuple[list[dict[str, Any]], int]:
    """Every ``--request-rate`` against ``url``; returns (results, number of failed).

    With ``pids`` (part name -> process id) each result gets ``cpu_seconds`` per part
    during its run and ``router_tokens_per_cpu_s`` (output tokens per router CPU second,
    when a part is called "router")."""
    base = url.rstrip("/")
    model, vocab = model_and_vocab(base, args.model, args.tokenizer, args.vocab_size)
    if args.dataset_name == "multi-turn":
        return _run_multi_turn(args, base, model, percentiles, label)
    all_results = []
    failed = 0
    for i, rate in enumerate(args.request_rate):
        # NOTE: fresh prompts per rate: repeating them would hit the prefix cache.
        prompts = sample_prompts(args.num_prompts, args.random_input_len,
                                 args.random_output_len, args.random_range_ratio, vocab,
                                 args.seed + i, mix)
        print(f"Traffic request rate: {rate}\nBurstiness factor: {args.burstiness}"
              f"\nMaximum request concurrency: {args.max_concurrency}", flush=True)
        cpu_before = _cpu_seconds(pids) if pids else {}
        results, duration = asyncio.run(run_rate(
            base + args.endpoint, model, prompts, rate, args.burstiness, args.max_concurrency,
            args.ignore_eos, args.seed, args.structured, args.temperature))
        m = compute_metrics(results, duration, percentiles, slo)
        if pids:
            cpu = {k: v - cpu_before[k] for k, v in _cpu_seconds(pids).items()}
            m["cpu_seconds"] = cpu
            if cpu.get("router"):
                m["router_tokens_per_cpu_s"] = m["total_output_tokens"] / cpu["router"]
        m.update(date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend="tandem",
                 model_id=model, tokenizer_id=model, num_prompts=args.num_prompts,
                 request_rate=rate, burstiness=args.burstiness,
                 max_concurrency=args.max_concurrency, label=label, structured=args.structured)
        print_result(m, percentiles, rate)
        if args.profile:
            print_decode_breakdown(m)
        failed += m["failed"]
        all_results.append(m)
    return all_results, failed


@contextlib.contextmanager
def _py_spy(pids: dict[str, int], out_dir: str, label: str) -> Iterator[list[str]]:
    """Record each process with py-spy (when installed) while the block runs; yields the
    flame graph paths (``<out_dir>/<label>-<name>.svg``), written when it ends."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("--profile: py-spy not found (pip install py-spy): no flame graphs",
              flush=True)
        yield []
        return
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    procs, paths = [], []
    for name, pid in pids.items():
        path = str(Path(out_dir) / f"{label}-{name}.svg")
        procs.append(subprocess.Popen([exe, "record", "--pid", str(pid), "--output", path,
                                       "--rate", "200", "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        paths.append(path)
    try:
        yield paths
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _run_multi_turn(args: argparse.Namespace, base: str, model: str,
                    percentiles: list[float], label: str | None
                    ) -> tuple[list[dict[str, Any]], int]:
    """The multi-turn workload at every ``--request-rate`` (conversations per second)."""
    from tandem.bench.multiturn import (
        MultiTurnShape,
        build_conversations,
        print_turns,
        run_conversations,
        turn_metrics,
    )
    from tandem.engine.model_files import load_tokenizer

    shape = MultiTurnShape(args.multi_turn_conversations, args.multi_turn_turns,
                           args.multi_turn_system_len, args.multi_turn_user_len,
                           args.multi_turn_answer_len)
    tokenizer = load_tokenizer(args.tokenizer)
    all_results, failed = [], 0
    for i, rate in enumerate(args.request_rate):
        # NOTE: fresh conversations per rate (same system prompt text only within a rate)
        system, users = build_conversations(shape, tokenizer, args.seed + i)
        print(f"Conversation rate: {rate}\nMaximum request concurrency: "
              f"{args.max_concurrency}", flush=True)
        results, duration = asyncio.run(run_conversations(
            base + "/v1/chat/completions", model, shape, system, users, rate,
            args.burstiness, args.max_concurrency, args.seed,
            args.multi_turn_skip_special_tokens))
        m = turn_metrics(results, duration, percentiles)
        m.update(date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend="tandem",
                 dataset_name="multi-turn", model_id=model, request_rate=rate,
                 max_concurrency=args.max_concurrency, label=label,
                 num_conversations=shape.num_conversations, num_turns=shape.num_turns,
                 system_len=shape.system_len, user_len=shape.user_len,
                 answer_len=shape.answer_len,
                 skip_special_tokens=args.multi_turn_skip_special_tokens)
        print_turns(m, percentiles)
        failed += m["failed"]
        all_results.append(m)
    return all_results, failed


def _run_with_faults(args: argparse.Namespace, stack: Any, faults: list[Any],
                     percentiles: list[float], slo: dict[str, float],
                     mix: list[tuple[int, float]] | None, label: str) -> list[dict[str, Any]]:
    """The same load on ``stack`` (fresh prompts: another seed) under the fault schedule;
    failed requests here are the measurement, not a failed bench."""
    from tandem.bench.faults import FaultInjector

    print(f"== {label}: {', '.join(f'{f.part}@{f.at_s:g}s' for f in faults)} ==", flush=True)
    shifted = argparse.Namespace(**{**vars(args), "seed": args.seed + 10_000})
    with FaultInjector(stack.launcher, faults) as injector:
        results, _ = _run_all(shifted, stack.http_url, percentiles, slo, mix, label=label)
    for at_s, what in injector.events:
        print(f"  {at_s:7.1f} s  {what}", flush=True)
    for m in results:
        m["fault_events"] = [{"t_s": t, "event": e} for t, e in injector.events]
    return results


def _print_fault_comparison(results: list[dict[str, Any]], percentiles: list[float]) -> None:
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


def launch_plan(modes: list[str], speculative_config: str | None
                ) -> list[tuple[str, str | None, str]]:
    """The stacks ``--launch`` starts, in order: ``(mode, speculative config or None,
    label)``; each mode once, or without and then with speculation (label ``MODE+spec``)."""
    plan: list[tuple[str, str | None, str]] = []
    for mode in modes:
        plan.append((mode, None, mode))
        if speculative_config is not None:
            plan.append((mode, speculative_config, f"{mode}+spec"))
    return plan


def _spec_counters(metrics_urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each engine's ``spec_decode_*`` totals, acceptance rate and mean acceptance length
    (``tandem bench latency``'s reading of ``/metrics``), by engine name."""
    import urllib.request

    from tandem.bench.latency import spec_decode_counters

    # NOTE: the engines refresh their /metrics counters once a second
    # (services/common/server.py): two periods pass before the scrape.
    time.sleep(2.0)
    out = {}
    for name, url in metrics_urls.items():
        with urllib.request.urlopen(url, timeout=10) as resp:
            out[name] = spec_decode_counters(resp.read().decode())
    return out


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem bench serve`. Returns 0 when every request succeeded."""
    args = build_parser().parse_args(argv)
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
    try:
        slo = parse_slo(args.goodput, ":") | parse_slo([args.slo], "=")
        if not args.temperature >= 0:
            raise ValueError(f"--temperature: must be >= 0, got {args.temperature}")
        if args.temperature and args.dataset_name == "multi-turn":
            raise ValueError("--temperature: the multi-turn dataset is greedy (its turns "
                             "are compared across stacks)")
        mix = None
        if args.input_len_mix:
            mix = [(int(a), float(b)) for a, b in
                   (x.split(":") for x in args.input_len_mix.split(","))]
        if args.dataset_name == "multi-turn":
            from tandem.bench.multiturn import MultiTurnShape

            MultiTurnShape(args.multi_turn_conversations, args.multi_turn_turns,
                           args.multi_turn_system_len, args.multi_turn_user_len,
                           args.multi_turn_answer_len)
        from tandem.bench.faults import Fault

        faults = [Fault.parse(f) for f in args.fault]
        if faults and not args.launch:
            raise ValueError("--fault: needs --launch (the bench must own the processes)")
        if args.speculative_config is not None:
            if not args.launch:
                raise ValueError("--speculative-config: needs --launch (the bench starts "
                                 "the stacks it compares)")
            from tandem.engine.config import SpeculativeConfig

            try:
                SpeculativeConfig.from_json(args.speculative_config)
            except ValueError as exc:
                raise ValueError(f"--speculative-config: {exc}") from exc
    except ValueError as exc:
        print(f"tandem bench serve: error: {exc}", file=sys.stderr)
        return 2
    if args.launch:
        from tandem.up import Stack, StackConfig, raise_on_sigterm

        raise_on_sigterm()

        all_results, failed = [], 0
        for mode, spec, label in launch_plan(args.launch, args.speculative_config):
            colocated = mode == "colocated"
            engine_args = list(args.launch_engine_arg)
            if mode == "disagg-no-reuse":
                engine_args += ["--kv-load-from-store=false", "--kv-publish-output=false"]
            cfg = StackConfig(port=0, grpc_port=0, model=args.launch_model, colocated=colocated,
                              num_prefill=args.launch_prefill, num_decode=args.launch_decode,
                              engine_args=engine_args,
                              router_args=list(args.launch_router_arg),
                              cpus_per_engine=0 if colocated else args.launch_disagg_cpus,
                              speculative_config=spec, engine_metrics=spec is not None)
            print(f"== launching {label} stack ==", flush=True)
            with Stack(cfg) as stack:
                if faults:
                    from tandem.bench.faults import FaultInjector

                    try:  # before the baseline run: a misnamed part wastes no run
                        FaultInjector(stack.launcher, faults).check()
                    except ValueError as exc:
                        print(f"tandem bench serve: error: {exc}", file=sys.stderr)
                        return 2
                pids = None
                if args.profile:
                    pids = {p.name: p.proc.pid for p in stack.parts
                            if p.proc is not None and p.name != "redis"}
                with (_py_spy(pids, args.profile_dir, label) if pids
                      else contextlib.nullcontext([])) as graphs:
                    results, n_failed = _run_all(args, stack.http_url, percentiles, slo,
                                                 mix, label=label, pids=pids)
                for path in graphs:
                    print(f"py-spy flame graph: {path}", flush=True)
                if spec is not None:
                    counters = _spec_counters({  # the engines that decode
                        n: u for n, u in stack.engine_metrics_urls.items()
                        if not n.startswith("prefill")})
                    for m in results:
                        m["speculative"] = counters
                if faults:
                    results += _run_with_faults(args, stack, faults, percentiles, slo, mix,
                                                label=f"{label}+faults")
                    _print_fault_comparison(results, percentiles)
            all_results += results
            failed += n_failed
        if len(all_results) > 1:
            print(side_by_side(all_results))
    else:
        all_results, failed = _run_all(args, args.url, percentiles, slo, mix, args.label)
    out: Any = all_results[0] if len(all_results) == 1 else all_results
    if args.json is not None:
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.save_result:
        name = args.result_filename or f"tandem-{datetime.now():%Y%m%d-%H%M%S}.json"
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.result_dir) / name).write_text(json.dumps(out, indent=2))
    if args.plot and args.dataset_name == "multi-turn":
        from tandem.bench.multiturn import plot_turns

        plot_turns(all_results, args.plot)
    elif args.plot:
        plot(all_results, args.plot, percentiles)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
