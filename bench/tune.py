"""`tandem tune`: find the configuration with the highest goodput that meets an SLO.

Given a model, a workload (``tandem bench serve``'s random prompts: ``--random-input-len``
or ``--input-len-mix``, ``--random-output-len``; or the lengths of a recorded run,
``--trace``), an SLO (``--slo ttft=MS,tpot=MS``,
``--slo-percentile``) and the CPUs (``--cpus``), it starts a stack (`tandem up`) per
candidate configuration -- a split of the CPUs between colocated replicas or prefill and
decode engines, ``max_num_batched_tokens``, ``max_num_seqs`` and the chunked-prefill size
(``long_prefill_token_threshold``) -- and runs ``tandem bench serve``'s load against it at
increasing request rates until the SLO breaks. The search is coarse-to-fine within
``--budget`` minutes (bench/tune_search.py); the default configuration is always measured
first, so the result says what tuning gained. Prints the frontier (each configuration's
best load meeting the SLO) and writes into ``--output-dir``: ``tune.json``,
``frontier.png``, ``values.yaml`` (Helm values of the best configuration) and each
stack's logs; the best configuration's `tandem up` command line is printed and in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tandem.bench.tune_output import (
    frontier_table,
    helm_snippet,
    plot,
    report,
    up_args,
    up_command,
    verdict,
)
from tandem.bench.tune_search import (
    Budget,
    Measure,
    RatePoint,
    RatePolicy,
    Slo,
    search,
)
from tandem.bench.tune_space import Candidate, Space, cpu_topologies, default_candidate

#: Engine flags the tuner sets itself (a fixed value belongs in the search space).
_TUNED_FLAGS = ("--max-num-batched-tokens", "--max-num-seqs", "--long-prefill-token-threshold")


@dataclass(frozen=True)
class Workload:
    """The load of each run: ``tandem bench serve``'s random dataset.

    Attributes:
        num_prompts: requests per run (each rate gets fresh prompts).
        input_len / output_len: tokens (``input_len_mix``: (length, weight) pairs
            drawn per request instead of ``input_len``).
        range_ratio: lengths uniform in ``[len * (1 - r), len * (1 + r)]``.
        burstiness: gamma shape of the arrivals (1: Poisson).
        trace: recorded (input length, output length) pairs, replayed in order (cycled
            up to ``num_prompts``) instead of the random lengths.
    """

    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    input_len_mix: tuple[tuple[int, float], ...] | None = None
    burstiness: float = 1.0
    seed: int = 0
    trace: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.trace is not None and self.input_len_mix is not None:
            raise ValueError("--trace: the trace gives the lengths; drop --input-len-mix")


def parse_slo(text: str, percentile: float) -> Slo:
    """``ttft=MS,tpot=MS[,e2el=MS]`` (``tandem bench serve --slo``'s syntax) -> Slo.

    Raises:
        ValueError: naming ``--slo`` (or ``--slo-percentile``).
    """
    from tandem.bench.serve import parse_slo

    try:
        bounds = parse_slo([text], "=")
    except ValueError as exc:
        raise ValueError(f"--slo: {exc}") from exc
    return Slo(ttft_ms=bounds.get("ttft"), tpot_ms=bounds.get("tpot"),
               e2el_ms=bounds.get("e2el"), percentile=percentile)


def parse_input_len_mix(text: str) -> tuple[tuple[int, float], ...]:
    """``LEN:WEIGHT,...`` -> ((length, weight), ...).

    Raises:
        ValueError: naming ``--input-len-mix``.
    """
    out = []
    for part in text.split(","):
        length, sep, weight = part.partition(":")
        try:
            pair = (int(length), float(weight))
        except ValueError:
            pair = (0, 0.0)
        if not sep or pair[0] < 1 or not pair[1] > 0:
            raise ValueError(f"--input-len-mix: each item must be LEN:WEIGHT with LEN >= 1 "
                             f"and WEIGHT > 0, got {part!r}")
        out.append(pair)
    return tuple(out)


def load_trace(path: str) -> tuple[tuple[int, int], ...]:
    """(input length, output length) of each completed request of a recorded run:
    ``tandem bench serve --json`` output (one result or a list of them, their
    ``input_lens`` / ``output_lens``), or JSON lines with ``input_len`` / ``output_len``.

    Raises:
        ValueError: naming ``--trace`` when the file is missing, malformed or empty.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--trace {path}: {exc.strerror}") from exc
    pairs: list[tuple[int, int]] = []
    try:
        try:
            data = json.loads(text)
            runs = data if isinstance(data, list) else [data]
            for run in runs:
                pairs += zip(run["input_lens"], run["output_lens"], strict=True)
        except json.JSONDecodeError:
            for line in text.splitlines():
                if line.strip():
                    row = json.loads(line)
                    pairs.append((row["input_len"], row["output_len"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--trace {path}: not a `tandem bench serve --json` result nor "
                         f"JSON lines of input_len/output_len ({exc!r})") from exc
    # NOTE: a failed request recorded no output; it says nothing about the load.
    out = tuple((int(i), int(o)) for i, o in pairs if int(i) >= 1 and int(o) >= 1)
    if not out:
        raise ValueError(f"--trace {path}: no request with input and output lengths >= 1")
    return out


def check_engine_args(engine_args: list[str]) -> None:
    """Raises ValueError when an ``--engine-arg`` sets a knob the tuner searches."""
    for a in engine_args:
        if a.split("=", 1)[0] in _TUNED_FLAGS:
            raise ValueError(f"--engine-arg {a}: the tuner searches {a.split('=', 1)[0]} "
                             "itself; narrow the search instead")


def point_from_metrics(rate: float, m: dict[str, Any], slo: Slo) -> RatePoint:
    """A :class:`RatePoint` from ``tandem bench serve``'s ``compute_metrics`` result
    (computed with ``slo.bounds_ms()`` and ``slo.percentile`` among the percentiles)."""
    sent = m["completed"] + m["failed"]
    good = m["request_goodput"] * m["duration"]
    return RatePoint(rate=rate, goodput=m["request_goodput"],
                     throughput=m["request_throughput"],
                     attainment=good / sent if sent else 0.0,
                     output_throughput=m["output_throughput"],
                     ttft_ms=m[f"p{slo.percentile:g}_ttft_ms"],
                     tpot_ms=m[f"p{slo.percentile:g}_tpot_ms"],
                     failed=m["failed"], duration_s=m["duration"])


def sample(w: Workload, n: int, vocab_size: int, seed: int) -> list[tuple[list[int], int]]:
    """``n`` prompts of the workload (``tandem bench serve``'s ``sample_prompts``)."""
    from tandem.bench.serve import sample_prompts

    if w.trace is not None:
        lengths = [w.trace[i % len(w.trace)] for i in range(n)]
        ids = sample_prompts(n, max(i for i, _ in lengths), 1, 0.0, vocab_size, seed)
        return [(p[:i], o) for (i, o), (p, _) in zip(lengths, ids, strict=True)]
    mix = list(w.input_len_mix) if w.input_len_mix else None
    return sample_prompts(n, w.input_len, w.output_len, w.range_ratio, vocab_size, seed, mix)


def run_prompts(w: Workload, vocab_size: int, rate: float) -> list[tuple[list[int], int]]:
    """The prompts of a run at ``rate``: the same input and output lengths at every rate
    (so runs differ only in their arrivals), other token ids at each rate (so no run hits
    the prefix cache of an earlier one on the same stack)."""
    from tandem.bench.serve import sample_prompts

    shape = sample(w, w.num_prompts, vocab_size, w.seed)
    longest = max(len(ids) for ids, _ in shape)
    ids = sample_prompts(len(shape), longest, 1, 0.0, vocab_size,
                         w.seed + 1 + round(rate * 1000))
    return [(fresh[:len(p)], out) for (p, out), (fresh, _) in zip(shape, ids, strict=True)]


class StackEvaluator:
    """Measures candidates on real stacks: ``open(candidate)`` starts it as `tandem up`
    would (``up_args``), yields a function that runs the workload at a rate with
    ``tandem bench serve``'s ``sample_prompts`` / ``run_rate`` / ``compute_metrics``, and
    stops it on exit. Each stack logs to ``log_dir/<n>``."""

    def __init__(self, model: str | None, engine_args: list[str], workload: Workload,
                 slo: Slo, log_dir: Path) -> None:
        from tandem.engine.model_files import load_tokenizer

        self.model, self.engine_args, self.workload, self.slo = model, engine_args, workload, slo
        self.log_dir = log_dir
        self.vocab_size = len(load_tokenizer(model))
        self._count = 0

    @contextmanager
    def open(self, c: Candidate) -> Iterator[Measure]:
        import httpx

        from tandem.bench.serve import compute_metrics, run_rate
        from tandem.up import Stack, build_parser, config_from_args

        self._count += 1
        argv = [*up_args(c, self.model, self.engine_args), "--port", "0", "--grpc-port", "0",
                "--log-dir", str(self.log_dir / f"{self._count:02d}")]
        cfg = config_from_args(build_parser().parse_args(argv))
        w, slo = self.workload, self.slo
        with Stack(cfg) as stack:
            base = stack.http_url
            served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            url = f"{base}/v1/completions"
            # A few requests first: the first steps of a fresh engine are not its pace.
            asyncio.run(run_rate(url, served, sample(w, 4, self.vocab_size, w.seed - 1), float("inf"),
                                 1.0, None, True, w.seed))

            def measure(rate: float) -> RatePoint:
                # NOTE: same arrival seed at every rate: the gaps only scale with the rate.
                prompts = run_prompts(w, self.vocab_size, rate)
                results, duration = asyncio.run(run_rate(
                    url, served, prompts, rate, w.burstiness, None, True, w.seed))
                m = compute_metrics(results, duration, [50.0, slo.percentile],
                                    slo.bounds_ms())
                return point_from_metrics(rate, m, slo)

            yield measure


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem tune", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="fixed flag for every engine, e.g. --engine-arg=--dtype=bfloat16 "
                        "(not one of the searched knobs)")
    p.add_argument("--slo", required=True, help="ttft=MS,tpot=MS[,e2el=MS]: one request's bounds")
    p.add_argument("--slo-percentile", type=float, default=90.0,
                   help="a load meets the SLO when this percent of its requests meet every "
                        "bound (default 90)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="CPUs the engines may use (default: all); split between engines")
    p.add_argument("--budget", type=float, default=25.0,
                   help="minutes the search may take (it stops between runs)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per run")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--input-len-mix", default=None,
                   help="LEN:WEIGHT,... draw each input length from these (e.g. 64:0.8,1024:0.2)")
    p.add_argument("--trace", default=None,
                   help="replay the input/output lengths of a recorded run: `tandem bench "
                        "serve --json` output or JSON lines of input_len/output_len")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-rate", type=float, default=1.0,
                   help="first request rate tried (req/s); later candidates start at the "
                        "best rate found")
    p.add_argument("--min-rate", type=float, default=0.25,
                   help="lowest request rate tried (req/s): a run takes about "
                        "--num-prompts / rate seconds")
    p.add_argument("--rate-factor", type=float, default=2.0,
                   help="rate step while the SLO holds (or breaks)")
    p.add_argument("--bisect-steps", type=int, default=2,
                   help="bisections between the last rate that held and the first that broke")
    p.add_argument("--refine-topologies", type=int, default=2,
                   help="how many of the best CPU splits get their knobs refined")
    p.add_argument("--confirm-share", type=float, default=0.15,
                   help="share of the budget kept to re-measure the default and the best "
                        "one after the other at the end (0: off)")
    p.add_argument("--output-dir", type=Path, default=Path("tandem-tune"),
                   help="tune.json, frontier.png, values.yaml and the stacks' logs")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem tune`. Returns 0 when a configuration met the SLO, 1 when
    none did, 2 on a usage error."""
    args = build_parser().parse_args(argv)
    try:
        slo = parse_slo(args.slo, args.slo_percentile)
        workload = Workload(args.num_prompts, args.random_input_len, args.random_output_len,
                            args.random_range_ratio,
                            parse_input_len_mix(args.input_len_mix) if args.input_len_mix
                            else None, args.burstiness, args.seed,
                            load_trace(args.trace) if args.trace else None)
        policy = RatePolicy(start=args.start_rate, factor=args.rate_factor,
                            bisect_steps=args.bisect_steps, min_rate=args.min_rate)
        if not 1 <= args.cpus <= (os.cpu_count() or 1):
            raise ValueError(f"--cpus must be in [1, {os.cpu_count()}], got {args.cpus}")
        check_engine_args(args.engine_arg)
        if not 0 <= args.confirm_share < 1:
            raise ValueError(f"--confirm-share must be in [0, 1), got {args.confirm_share}")
        budget = Budget(args.budget * 60.0)
        space = Space(default=default_candidate(), topologies=cpu_topologies(args.cpus))
    except ValueError as exc:
        print(f"tandem tune: error: {exc}", file=sys.stderr)
        return 2
    from tandem.up import raise_on_sigterm

    raise_on_sigterm()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    evaluator = StackEvaluator(args.model, list(args.engine_arg), workload, slo, out / "logs")
    print(f"tandem tune: {slo.label}; {len(space.topologies)} CPU splits of {args.cpus} CPUs; "
          f"budget {args.budget:g} min", flush=True)
    result = search(space, evaluator.open, slo, policy, budget,
                    refine_topologies=args.refine_topologies,
                    confirm_share=args.confirm_share,
                    log=lambda line: print(line, flush=True))
    settings = {"model": args.model, "engine_args": args.engine_arg, "cpus": args.cpus,
                "budget_min": args.budget, "workload": asdict(workload),
                "rate_policy": asdict(policy)}
    data = report(result, args.model, args.engine_arg, settings)
    (out / "tune.json").write_text(json.dumps(data, indent=2))
    snippet = helm_snippet(result, args.engine_arg)
    if snippet:
        (out / "values.yaml").write_text(snippet)
    try:
        plot(result, str(out / "frontier.png"))
    except ImportError:
        print("tandem tune: no plot: matplotlib is not installed", file=sys.stderr)
    print(f"\n== frontier ({slo.label}; stopped: {result.stopped}, "
          f"{result.elapsed_s / 60:.1f} min) ==")
    print(frontier_table(result))
    print(f"\n{verdict(result)}")
    best = result.best()
    if best is None:
        return 1
    print(f"\n{up_command(best.candidate, args.model, args.engine_arg)}")
    print(f"\nHelm values ({out / 'values.yaml'}):\n{snippet}")
    print(f"report: {out / 'tune.json'}, plot: {out / 'frontier.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
