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
import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

# NOTE: the bench's public names stay importable from here (tune, router_ceiling, mixed,
# multiturn and the tests import them from tandem.bench.serve).
from tandem.bench import kvstore_disk
from tandem.bench.serve_args import build_parser, parse_slo
from tandem.bench.serve_client import (
    RequestResult,
    http_session,
    run_rate,
    sample_prompts,
    sse_events,
)
from tandem.bench.serve_doors import DOORS
from tandem.bench.serve_report import (
    compute_metrics,
    doors_table,
    plot,
    print_cpu_seconds,
    print_fault_comparison,
    print_result,
    side_by_side,
)
from tandem.bench.serve_stacks import launch_plan, stack_config, stack_plan
from tandem.bench.serve_tracing import launch_tracing

__all__ = ["RequestResult", "build_parser", "compute_metrics",
           "http_session", "launch_plan", "main", "model_and_vocab", "parse_slo",
           "print_result", "run_rate", "sample_prompts", "side_by_side", "sse_events"]


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
             label: str | None, pids: dict[str, int] | None = None,
             more_urls: Sequence[str] = ()
             ) -> tuple[list[dict[str, Any]], int]:
    """Every ``--request-rate`` against ``url``; returns (results, number of failed).
    ``more_urls``: more routers (multi-turn: a conversation's turns rotate over them all).

    With ``pids`` (part name -> process id) each result gets ``cpu_seconds`` per part
    during its run and ``router_tokens_per_cpu_s`` (output tokens per router CPU second,
    when a part is called "router")."""
    base = url.rstrip("/")
    model, vocab = model_and_vocab(base, args.model, args.tokenizer, args.vocab_size)
    if args.dataset_name == "multi-turn":
        return _run_multi_turn(args, [base, *more_urls], model, percentiles, label)
    tokenizer = None
    if not all(DOORS[t].takes_ids for t in args.endpoint_type):
        from tandem.engine.model_files import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    all_results = []
    failed = 0
    for i, rate in enumerate(args.request_rate):
        # NOTE: each rate starts one door later, so no door always runs first (drift on a
        # shared machine spreads over the doors)
        shift = i % len(args.endpoint_type)
        for endpoint_type in args.endpoint_type[shift:] + args.endpoint_type[:shift]:
            j = args.endpoint_type.index(endpoint_type)
            door = DOORS[endpoint_type]
            # NOTE: fresh prompts per rate and door: repeating them would hit the prefix
            # cache. The first door's seed is the one a single door gets.
            prompts: list[tuple[Any, int]] = list(sample_prompts(
                args.num_prompts, args.random_input_len, args.random_output_len,
                args.random_range_ratio, vocab, args.seed + i + 1000 * j, mix))
            if not door.takes_ids:
                assert tokenizer is not None, "loaded for the text doors"
                prompts = [(tokenizer.decode(ids), o) for ids, o in prompts]
            print(f"Endpoint type: {endpoint_type}\nTraffic request rate: {rate}"
                  f"\nBurstiness factor: {args.burstiness}"
                  f"\nMaximum request concurrency: {args.max_concurrency}", flush=True)
            cpu_before = _cpu_seconds(pids) if pids else {}
            results, duration = asyncio.run(run_rate(
                base + (args.endpoint or door.path), model, prompts, rate, args.burstiness,
                args.max_concurrency, args.ignore_eos, args.seed, args.structured,
                args.temperature, door))
            m = compute_metrics(results, duration, percentiles, slo)
            if pids:
                cpu = {k: v - cpu_before[k] for k, v in _cpu_seconds(pids).items()}
                m["cpu_seconds"] = cpu
                if cpu.get("router"):
                    m["router_tokens_per_cpu_s"] = m["total_output_tokens"] / cpu["router"]
            m.update(date=datetime.now().strftime("%Y%m%d-%H%M%S"), backend="tandem",
                     endpoint_type=endpoint_type, model_id=model, tokenizer_id=model,
                     num_prompts=args.num_prompts, request_rate=rate,
                     burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                     label=label, structured=args.structured)
            print_result(m, percentiles, rate)
            if args.profile:
                print_cpu_seconds(m)
            failed += m["failed"]
            all_results.append(m)
    if len(args.endpoint_type) > 1:
        print(doors_table(all_results, args.endpoint_type[0]))
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


def _run_multi_turn(args: argparse.Namespace, bases: list[str], model: str,
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
            [b + "/v1/chat/completions" for b in bases], model, shape, system, users, rate,
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


def _more_routers(stack: Any, args: argparse.Namespace) -> list[str]:
    """Start ``--launch-routers`` - 1 more routers on the stack's Redis; their URLs."""
    from tandem.launch import Part, free_port, http_ok, tandem_argv

    urls = []
    for i in range(1, args.launch_routers):
        url = f"http://127.0.0.1:{free_port()}"
        argv = ["router", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                "--grpc-port", "0", "--redis-url", stack.redis_url,
                *args.launch_router_arg, *(["--model", args.launch_model]
                                           if args.launch_model else [])]
        stack.launcher.launch([Part(f"router-{i}", tandem_argv(*argv),
                                    lambda u=url: http_ok(f"{u}/ready"), url)],
                              stack.config.startup_timeout_s)
        urls.append(url)
    return urls


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


def check_doors(args: argparse.Namespace) -> None:
    """Raises: ValueError naming the flag when ``--endpoint-type`` does not go with the
    other flags (a door that refuses ``ignore_eos``, one ``--endpoint`` for several
    doors, the multi-turn dataset, which speaks chat)."""
    types = args.endpoint_type
    if len(set(types)) != len(types):
        raise ValueError(f"--endpoint-type: each door once, got {' '.join(types)}")
    if args.endpoint is not None and len(types) > 1:
        raise ValueError("--endpoint: one path, for one --endpoint-type")
    refusing = [t for t in types if not DOORS[t].takes_ignore_eos]
    if args.ignore_eos and refusing:
        raise ValueError(f"--ignore-eos: the {', '.join(refusing)} door(s) refuse ignore_eos "
                         "and min_tokens (a 400); --structured json forces every output "
                         "to its length through every door")
    if args.dataset_name == "multi-turn" and types != ["completions"] and types != ["chat"]:
        raise ValueError("--endpoint-type: the multi-turn dataset speaks chat")


def _checked(args: argparse.Namespace) -> tuple[dict[str, float], Any, list[Any]]:
    """The flags' cross-checks before anything starts: ``(slo, input length mix, faults)``.

    Raises:
        ValueError: naming the flag at fault.
    """
    slo = parse_slo(args.goodput, ":") | parse_slo([args.slo], "=")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature: must be >= 0, got {args.temperature}")
    if args.temperature and args.dataset_name == "multi-turn":
        raise ValueError("--temperature: the multi-turn dataset is greedy (its turns "
                         "are compared across stacks)")
    check_doors(args)
    if args.launch_routers != 1 and (args.launch_routers < 1 or not args.launch
                                     or args.dataset_name != "multi-turn"):
        raise ValueError("--launch-routers: N >= 1, with --launch and --dataset-name "
                         "multi-turn (its turns rotate over the routers)")
    mix = None
    if args.input_len_mix:
        mix = [(int(a), float(b)) for a, b in
               (x.split(":") for x in args.input_len_mix.split(","))]
    if args.dataset_name == "multi-turn":
        from tandem.bench.multiturn import MultiTurnShape

        MultiTurnShape(args.multi_turn_conversations, args.multi_turn_turns,
                       args.multi_turn_system_len, args.multi_turn_user_len,
                       args.multi_turn_answer_len)
    kvstore_disk.check_args(args)
    from tandem.bench.faults import Fault

    faults = [Fault.parse(f) for f in args.fault]
    for flag, given in (("--fault", faults), ("--launch-tracing", args.launch_tracing),
                        ("--speculative-config", args.speculative_config is not None)):
        if given and not args.launch:
            raise ValueError(f"{flag}: needs --launch (the bench must own the processes)")
    if args.speculative_config is not None:
        from tandem.engine.config import SpeculativeConfig

        try:
            SpeculativeConfig.from_json(args.speculative_config)
        except ValueError as exc:
            raise ValueError(f"--speculative-config: {exc}") from exc
    return slo, mix, faults


def _run_stack(args: argparse.Namespace, stack: Any, cfg: Any, spec: Any, label: str,
               receiver: Any, checks: tuple[dict[str, float], Any, list[Any]],
               percentiles: list[float]) -> tuple[list[dict[str, Any]], int]:
    """The runs against one launched stack (with faults, profiles and the stack's own
    counters as asked): ``(results, failed requests)``.

    Raises:
        ValueError: a ``--fault`` naming a part the stack does not have.
    """
    slo, mix, faults = checks
    if faults:
        from tandem.bench.faults import FaultInjector

        FaultInjector(stack.launcher, faults).check()  # before the baseline: no run wasted
    pids = None
    if args.profile:
        pids = {p.name: p.proc.pid for p in stack.parts
                if p.proc is not None and p.name != "redis"}
    with (_py_spy(pids, args.profile_dir, label) if pids
          else contextlib.nullcontext([])) as graphs:
        results, n_failed = _run_all(args, stack.http_url, percentiles, slo, mix, label=label,
                                     pids=pids, more_urls=_more_routers(stack, args))
    for path in graphs:
        print(f"py-spy flame graph: {path}", flush=True)
    if spec is not None:
        counters = _spec_counters({  # the engines that decode
            n: u for n, u in stack.engine_metrics_urls.items() if not n.startswith("prefill")})
        for m in results:
            m["speculative"] = counters
    if faults:
        results += _run_with_faults(args, stack, faults, percentiles, slo, mix,
                                    label=f"{label}+faults")
        print_fault_comparison(results, percentiles)
    if args.launch_kvstore_tiers and stack.kvstore_metrics_url:
        kvstore_disk.report(results, label, stack.kvstore_metrics_url, cfg.kvstore_disk_path)
    if receiver is not None:
        for m in results:
            m["otlp_spans_received"] = receiver.num_spans()
        print(f"OTLP spans received: {receiver.num_spans()}", flush=True)
    return results, n_failed


def _write_outputs(args: argparse.Namespace, all_results: list[dict[str, Any]],
                   percentiles: list[float]) -> None:
    """``--json``, ``--save-result`` and ``--plot``."""
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem bench serve`. Returns 0 when every request succeeded, 1 when
    some failed, 2 on a bad flag."""
    args = build_parser().parse_args(argv)
    percentiles = [float(x) for x in args.metric_percentiles.split(",") if x]
    try:
        checks = _checked(args)
    except ValueError as exc:
        print(f"tandem bench serve: error: {exc}", file=sys.stderr)
        return 2
    if not args.launch:
        slo, mix, _ = checks
        all_results, failed = _run_all(args, args.url, percentiles, slo, mix, args.label)
        _write_outputs(args, all_results, percentiles)
        return 0 if failed == 0 else 1
    from tandem.up import Stack, raise_on_sigterm

    raise_on_sigterm()
    all_results, failed = [], 0
    for run, (mode, spec, label, tracing, tier, events) in enumerate(stack_plan(args)):
        cfg = stack_config(args, mode, spec, tier, events, run)
        print(f"== launching {label} stack ==", flush=True)
        with launch_tracing(tracing) as (tracing_args, receiver), \
                Stack(dataclasses.replace(cfg, tracing_args=tracing_args)) as stack:
            try:
                results, n_failed = _run_stack(args, stack, cfg, spec, label, receiver,
                                               checks, percentiles)
            except ValueError as exc:
                print(f"tandem bench serve: error: {exc}", file=sys.stderr)
                return 2
        all_results += results
        failed += n_failed
    if len(all_results) > 1:
        print(side_by_side(all_results))
    _write_outputs(args, all_results, percentiles)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
