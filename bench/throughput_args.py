"""The flags of `tandem bench throughput` (``bench/throughput.py`` documents the run)."""

from __future__ import annotations

import argparse
import importlib.util

from tandem.bench.throughput_peers import LLAMA_CPP_MISSING
from tandem.engine.engine_args import add_engine_flags

BACKENDS = ("tandem", "hf", "llama.cpp")
#: The engine config fields that are flags here (``engine/engine_args.py``); --seed,
#: --deterministic and the parallel sizes mean something of the benchmark's own.
_ENGINE_FLAGS = ("model", "dtype", "quantization", "cache_dtype", "kv_cache_memory_bytes",
                 "model_impl", "device", "enforce_eager", "gpu_memory_utilization",
                 "max_num_seqs", "max_num_batched_tokens")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tandem bench throughput",
        description="Offline throughput of tandem vs transformers vs llama.cpp. The engine "
        "flags (those of `tandem serve`) set the tandem backend's LLM(...).")
    p.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="backend to run; repeat for several (default: tandem)",
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    add_engine_flags(p, only=_ENGINE_FLAGS, speculative=False,
                     helps={"device": "tandem and hf: cpu | cuda | cuda:N (llama.cpp: CPU only)"})
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--hf-batch-size", type=int, default=16, help="hf: static batch size")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed runs per backend, each on fresh prompts (seed, seed+1, ...); "
        "the median is reported",
    )
    p.add_argument(
        "--structured",
        choices=["json"],
        default=None,
        help="also run tandem with every request constrained by a JSON schema (tandem+json)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="also run tandem with speculative decoding (tandem+spec), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3}\'; prints its acceptance',
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="also run tandem with batch-invariant kernels (tandem+det, "
        "LLM(deterministic=True)) and report the throughput ratio",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run tandem with this many tensor-parallel worker processes (tandem+par, "
        "beside tandem's one in-process worker) and report the ratio and the all-reduce time",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="also run tandem with this many pipeline stages (tandem+par; with "
        "--tensor-parallel-size: both)",
    )
    p.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=None,
        help="tandem+par: batches in flight at once (default: the pipeline's stages, "
        "vLLM's batch queue; 1: one batch at a time, the A/B without it)",
    )
    p.add_argument(
        "--prompt-pattern",
        choices=["random", "repeated"],
        default="random",
        help="random: uniform token ids; repeated: a random quarter of --input-len "
        "repeated four times (text that prompt lookup can copy from)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="tandem runs only: sample at this temperature (0: greedy); e.g. a workload "
        "whose outputs prompt lookup cannot predict (the other backends decode greedily)",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write results to PATH")
    args = p.parse_args(argv)
    args.backend = args.backend or ["tandem"]
    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.temperature > 0 and set(args.backend) - {"tandem"}:
        p.error("--temperature: tandem only (hf and llama.cpp decode greedily here)")
    if args.speculative_config is not None:
        from tandem.engine.config import SpeculativeConfig

        try:
            args.speculative = SpeculativeConfig.from_json(args.speculative_config)
        except ValueError as exc:
            p.error(f"--speculative-config: {exc}")
        if "tandem" not in args.backend:
            args.backend.insert(0, "tandem")
    # Checked here rather than at load time: the other backends load first and
    # the run would fail only after them.
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        p.error("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
    args.parallel = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    mcb = args.max_concurrent_batches
    if mcb is not None and not 1 <= mcb <= args.pipeline_parallel_size:
        p.error("--max-concurrent-batches must be in [1, --pipeline-parallel-size]")
    if (args.deterministic or args.parallel) and "tandem" not in args.backend:
        args.backend.insert(0, "tandem")
    if "llama.cpp" in args.backend and importlib.util.find_spec("llama_cpp") is None:
        p.error(LLAMA_CPP_MISSING)
    if "llama.cpp" in args.backend and args.device != "cpu":
        p.error("--device: the llama.cpp backend runs on the CPU only here")
    return args
