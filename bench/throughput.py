"""`tandem bench throughput`: offline throughput of tandem vs transformers vs llama.cpp.

Every backend gets the same prompts: ``--num-prompts`` lists of ``--input-len``
random token ids (a fixed ``--seed``, special tokens excluded) and must produce
exactly ``--output-len`` tokens each (EOS ignored), greedily (tandem: at
``--temperature`` when given). Timing covers
generation only (weights loaded and one short warm-up request done before).

* ``tandem``: ``LLM.generate`` on all prompts at once (continuous batching).
* ``hf``: transformers ``generate`` in static batches of ``--hf-batch-size``
  (``min_new_tokens = max_new_tokens = output_len``), as vLLM's benchmark does.
* ``llama.cpp``: llama-cpp-python on the same GGUF file (its own quantized
  weights), one request at a time, fed token ids.

Prints requests/s, output tokens/s and total tokens/s per backend and each
backend's ratio to tandem; ``--json PATH`` writes the same numbers. With
``--repeat N`` every backend runs N timed passes, pass i on the prompts of seed
``--seed + i`` (fresh prompts, so tandem's prefix cache cannot serve a pass from
an earlier one), and the median pass is reported (all of them in the JSON's
``runs_s``). All backends are loaded first and their passes interleaved (pass 0
of every backend, then pass 1, ...), so each pass of one backend runs next to
the same pass of the others: shared machines change speed over minutes, and a
ratio of two blocks of passes taken minutes apart measures the machine as much
as the backends. The per-pass ratios are printed and written
(``paired_ratios``) beside the ratio of the medians.

``--deterministic`` adds a ``tandem+det`` run beside ``tandem``: the same prompts on an
engine with ``deterministic=True`` (batch-invariant kernels, issue 20's reproducible
greedy output), and reports its output tokens/s over tandem's, pass by pass, and whether
the two runs' greedy tokens were the same.

``--structured json`` adds a ``tandem+json`` run beside ``tandem``: the same LLM and
prompts, every request constrained by a JSON schema (an object holding an array of at
least ``--output-len`` non-empty strings, so no request completes its JSON, and so stops,
before ``--output-len`` tokens: both runs generate exactly the same number of tokens at
the same batch sizes). It reports the ratio of output tokens/s, constrained over
unconstrained, pass by pass, and the grammar's compile time: the first compile (the
xgrammar backend's setup over the vocabulary counted apart) and a cached one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from tandem.bench.throughput_args import parse_args
from tandem.bench.throughput_peers import (
    RunOne,
    run_hf,
    run_llama_cpp,
)
from tandem.bench.throughput_report import (
    acceptance,
    baseline_ratios,
    deterministic_report,
    machine_info,
    parallel_report,
    spec_stats,
    speculative_report,
    structured_report,
)


def prompt_vocab(model: str | None) -> tuple[int, set[int]]:
    """(vocabulary size, special token ids) of the model; no weights are loaded.

    A Hugging Face folder without tokenizer files (a weights-only test model) gives
    the config's ``vocab_size`` and no special ids.
    """
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if model is not None and os.path.isdir(model):
        if not any(os.path.isfile(os.path.join(model, n)) for n in names):
            from transformers import AutoConfig

            return int(AutoConfig.from_pretrained(model).vocab_size), set()
    from tandem.engine.model_files import load_tokenizer

    tok = load_tokenizer(model)
    return len(tok), set(tok.all_special_ids)


def make_prompts(
    vocab_size: int,
    special: set[int],
    num: int,
    length: int,
    seed: int,
    pattern: str = "random",
) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids drawn uniformly from the non-special vocab
    (``pattern="repeated"``: a random segment of ``ceil(length / 4)`` ids, repeated)."""
    import torch

    allowed = torch.tensor([t for t in range(vocab_size) if t not in special])
    gen = torch.Generator().manual_seed(seed)
    if pattern == "repeated":
        seg = -(-length // 4)
        idx = torch.randint(0, len(allowed), (num, seg), generator=gen).repeat(1, 4)[:, :length]
    else:
        idx = torch.randint(0, len(allowed), (num, length), generator=gen)
    return allowed[idx].tolist()




def _run_interleaved(
    runners: dict[str, RunOne], prompt_sets: list[list[list[int]]]
) -> dict[str, dict[str, Any]]:
    """Time every runner on every prompt set, pass by pass: pass i of each runner
    (in ``runners``' order) before pass i + 1 of any.

    Returns per runner ``elapsed_s`` (the median pass, seconds), ``runs_s``
    (every pass, in order) and ``num_output_tokens`` (of one pass; every pass
    must produce the same count).

    Raises:
        RuntimeError: when a runner's passes produce different numbers of output
            tokens.
    """
    runs: dict[str, list[float]] = {name: [] for name in runners}
    counts: dict[str, set[int]] = {name: set() for name in runners}
    for i, prompts in enumerate(prompt_sets):
        for name, run_one in runners.items():
            print(f"[{name}] pass {i + 1}/{len(prompt_sets)} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            counts[name].add(run_one(prompts))
            runs[name].append(time.perf_counter() - start)
    out = {}
    for name in runners:
        if len(counts[name]) != 1:
            raise RuntimeError(
                f"{name}: runs produced different output token counts: {sorted(counts[name])}"
            )
        out[name] = {
            "elapsed_s": statistics.median(runs[name]),
            "runs_s": runs[name],
            "num_output_tokens": counts[name].pop(),
        }
    return out


def run_tandem(
    args: argparse.Namespace,
    prompt_sets: list[list[list[int]]],
    speculative: Any = None,
    deterministic: bool = False,
    parallel: tuple[int, int] = (1, 1),
) -> tuple[RunOne, dict[str, Any]]:
    """Load tandem and warm it up; returns the timed pass and the result's metadata
    (with ``speculative``: the engine runs with that ``SpeculativeConfig``; with
    ``deterministic``: with batch-invariant kernels). The metadata's ``outputs``
    holds every pass's token ids (the deterministic comparison reads them)."""
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device=getattr(args, "device", "cpu"),
        enforce_eager=getattr(args, "enforce_eager", False),
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
        model_impl=getattr(args, "model_impl", "auto"),
        quantization=getattr(args, "quantization", None),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_cache_memory=getattr(args, "kv_cache_memory", None),
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        speculative_config=speculative,
        deterministic=deterministic,
        tensor_parallel_size=parallel[0],
        pipeline_parallel_size=parallel[1],
    )
    params = SamplingParams(temperature=args.temperature, ignore_eos=True,
                            max_tokens=args.output_len)
    warm = [prompt_sets[0][0][:16]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    outputs: list[list[list[int]]] = []

    def run_one(prompts: list[list[int]]) -> int:
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs.append([list(o.outputs[0].token_ids) for o in outs])
        return sum(len(o.outputs[0].token_ids) for o in outs)

    # Every repeat gets fresh prompts, so the prefix cache never serves one run
    # from an earlier one.
    core = llm.llm_engine.engine_core
    meta: dict[str, Any] = {
        "dtype": str(_dtype_of(llm)), "outputs": outputs,
        "kv_cache_dtype": core.layout.dtype, "kv_cache_tokens": core.num_blocks * core.layout.
        block_size, "kv_cache_bytes_per_token": core.kv_cache_bytes_per_token,
        "weight_bytes": core.model_facts.weight_bytes}
    if deterministic:
        return run_one, meta
    if parallel != (1, 1):
        core = llm.llm_engine.engine_core
        if getattr(args, "max_concurrent_batches", None) is not None:
            core.max_concurrent_batches = args.max_concurrent_batches
        meta["max_concurrent_batches"] = core.max_concurrent_batches
        meta["parallel_llm"] = llm
        return run_one, meta
    if speculative is not None:
        meta["spec_stats_at_start"] = spec_stats(llm)
        meta["spec_llm"] = llm
        return run_one, meta
    if args.structured:
        meta["structured_runner"] = run_tandem_structured(llm, args)
    if getattr(args, "speculative", None) is not None:
        meta["spec_runner"] = run_tandem(args, prompt_sets, args.speculative)
    if getattr(args, "deterministic", False):
        meta["det_runner"] = run_tandem(args, prompt_sets, deterministic=True)
    if getattr(args, "parallel", False):
        sizes = (args.tensor_parallel_size, args.pipeline_parallel_size)
        meta["par_runner"] = run_tandem(args, prompt_sets, parallel=sizes)
    return run_one, meta


def structured_schema(output_len: int) -> dict[str, Any]:
    """A JSON schema no output of ``output_len`` tokens can complete (see the module doc)."""
    return {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": output_len,
                "items": {"type": "string", "minLength": 1},
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    }


def run_tandem_structured(llm: Any, args: argparse.Namespace) -> tuple[RunOne, dict[str, Any]]:
    """The constrained run on ``llm`` (already loaded and warm), and its compile times."""
    from tandem.engine.sampling_params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=structured_schema(args.output_len))
    core = llm.llm_engine.engine_core
    start = time.perf_counter()
    _ = core.structured_output.backend  # the tokenizer's vocabulary, once per engine
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    core.check_structured_outputs(so)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    core.check_structured_outputs(so)
    cached_s = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=args.output_len, structured_outputs=so
    )

    def run_one(prompts: list[list[int]]) -> int:
        # NOTE: the unconstrained pass just ran on these prompts: reversed, they are as
        # long but share no cached block with it (each block hash covers its prefix).
        outs = llm.generate([p[::-1] for p in prompts], params, use_tqdm=False)
        for o in outs:
            # NOTE: a request the engine failed (its grammar) would finish "abort".
            if o.outputs[0].finish_reason != "length":
                raise RuntimeError(f"constrained request finished {o.outputs[0].finish_reason}")
        return sum(len(o.outputs[0].token_ids) for o in outs)

    meta = {
        "dtype": str(_dtype_of(llm)),
        "grammar_backend_setup_s": setup_s,
        "grammar_compile_first_s": first_s,
        "grammar_compile_cached_s": cached_s,
    }
    return run_one, meta


def _dtype_of(llm: Any) -> str:
    return llm.llm_engine.engine_core.model_facts.dtype


RUNNERS: dict[
    str, Callable[[argparse.Namespace, list[list[list[int]]]], tuple[RunOne, dict[str, Any]]]
] = {
    "tandem": run_tandem,
    "hf": run_hf,
    "llama.cpp": run_llama_cpp,
}


def main(argv: list[str] | None = None) -> int:
    """Run the selected backends and print/write their throughput. Returns 0."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    vocab_size, special = prompt_vocab(args.model)
    prompt_sets = [
        make_prompts(vocab_size, special, args.num_prompts, args.input_len, args.seed + i,
                     args.prompt_pattern)
        for i in range(args.repeat)
    ]
    runners, meta = _load_runners(args, prompt_sets)
    timed = _run_interleaved(runners, prompt_sets)
    outputs = {name: m.pop("outputs", None) for name, m in meta.items()}
    results = _rates(args, timed, meta)
    _print_table(args, results)
    ratios, paired = baseline_ratios(results)
    t = results.get("tandem")
    structured: dict[str, Any] = {}
    name = f"tandem+{args.structured}" if args.structured else ""
    if name in results and t is not None:
        structured = structured_report(name, results[name], t)
    speculative: dict[str, Any] = {}
    if "tandem+spec" in results and t is not None:
        speculative = speculative_report(results["tandem+spec"], t)
    deterministic: dict[str, Any] = {}
    if "tandem+det" in results and t is not None:
        deterministic = deterministic_report(results["tandem+det"], t, outputs,
                                             args.num_prompts * args.repeat)
    parallel: dict[str, Any] = {}
    if "tandem+par" in results and t is not None:
        parallel = parallel_report(results["tandem+par"], t, args, outputs)
    if args.json_path:
        doc = {
            "benchmark": "throughput",
            "command": "tandem bench throughput " + " ".join(argv or sys.argv[1:]),
            "args": {k: v for k, v in vars(args).items() if k != "speculative"},
            "machine": machine_info(),
            "results": results,
            "ratios": ratios,
            "paired_ratios": paired,
            "structured": structured,
            "speculative": speculative,
            "deterministic": deterministic,
            "parallel": parallel,
        }
        with open(args.json_path, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json_path}", file=sys.stderr)
    return 0


def _load_runners(args: argparse.Namespace, prompt_sets: list[list[list[int]]]
                  ) -> tuple[dict[str, RunOne], dict[str, dict[str, Any]]]:
    """Each selected backend's runner and facts (``RUNNERS``), tandem's variants
    (``tandem+<structured>``, ``+spec``, ``+det``, ``+par``) as runners of their own."""
    runners: dict[str, RunOne] = {}
    meta: dict[str, dict[str, Any]] = {}
    for backend in dict.fromkeys(args.backend):
        print(f"[{backend}] loading ...", file=sys.stderr, flush=True)
        runners[backend], meta[backend] = RUNNERS[backend](args, prompt_sets)
        if backend == "tandem" and args.structured:
            name = f"tandem+{args.structured}"
            runners[name], meta[name] = meta[backend].pop("structured_runner")
        for key, name in (("spec_runner", "tandem+spec"), ("det_runner", "tandem+det"),
                          ("par_runner", "tandem+par")):
            if backend == "tandem" and key in meta[backend]:
                runners[name], meta[name] = meta[backend].pop(key)
    return runners, meta


def _rates(args: argparse.Namespace, timed: dict[str, dict[str, Any]],
           meta: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each runner's timings with its facts and rates (requests/s, output and total
    tokens/s); the speculative run's acceptance and the parallel run's collectives
    collected (its engine shut down)."""
    results: dict[str, dict[str, Any]] = {}
    for backend, r in timed.items():
        m = meta[backend]
        if "spec_llm" in m:
            m["spec_decode"] = acceptance(m.pop("spec_stats_at_start"),
                                          spec_stats(m.pop("spec_llm")))
        if "parallel_llm" in m:
            par_llm = m.pop("parallel_llm")
            core = par_llm.llm_engine.engine_core
            m["collectives"] = core.executor.collective_stats()
            m["num_steps"] = core.num_steps
            m["max_num_batches_in_flight"] = core.max_num_batches_in_flight
            par_llm.shutdown()
        r.update(m)
        elapsed = r["elapsed_s"]
        num_in = args.num_prompts * args.input_len
        r["requests_per_s"] = args.num_prompts / elapsed
        r["output_tokens_per_s"] = r["num_output_tokens"] / elapsed
        r["total_tokens_per_s"] = (num_in + r["num_output_tokens"]) / elapsed
        results[backend] = r
        print(
            f"[{backend}] {elapsed:.1f} s, {r['output_tokens_per_s']:.1f} output tok/s",
            file=sys.stderr,
            flush=True,
        )
    return results


def _print_table(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    """Print the rates table, one row per runner."""
    print(
        f"\n{args.num_prompts} requests x ({args.input_len} in, {args.output_len} out), "
        f"dtype {args.dtype}"
    )
    header = f"{'backend':<10} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'time s':>8}"
    print(header)
    for name, r in results.items():
        print(
            f"{name:<10} {r['requests_per_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
            f"{r['total_tokens_per_s']:>12.1f} {r['elapsed_s']:>8.1f}"
        )

if __name__ == "__main__":
    sys.exit(main())
