"""KV tokens at a fixed cache size and KV store bytes per token, ``--kv-cache-dtype``
auto vs FP8, and how close FP8's logprobs stay (issue 38).

Usage: ``python -m tandem.bench.kv_cache_dtype [--model M] [--dtype D]
[--kv-cache-memory BYTES]``; prints a markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import time

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

PROMPT = "The history of the printing press begins"


def main(argv: list[str] | None = None) -> None:
    """Run each cache dtype on the same model and budget; print one table row each."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes")
    p.add_argument("--kv-cache-dtypes", default="auto,fp8,fp8_e5m2")
    p.add_argument("--max-tokens", type=int, default=32)
    ns = p.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, logprobs=5,
                            ignore_eos=True)
    print("| kv_cache_dtype | model dtype | blocks | KV tokens | bytes/token (store) "
          "| greedy tokens equal to auto | first-divergence rule | s |")
    print("|---|---|---|---|---|---|---|---|")
    ref = None
    for name in ns.kv_cache_dtypes.split(","):
        t0 = time.perf_counter()
        llm = LLM(model=ns.model, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory,
                  kv_cache_dtype=name, max_model_len=2048)
        core = llm.llm_engine.engine_core
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        if ref is None:
            ref = out
        same = sum(1 for _ in iter_equal(ref.token_ids, out.token_ids))
        ok = first_divergence_close(ref, out)
        tokens = core.num_blocks * core.config.cache.block_size
        print(f"| {name} | {core.model_facts.dtype} | {core.num_blocks} | {tokens} | "
              f"{core.kv_cache_bytes_per_token} | {same}/{len(ref.token_ids)} | "
              f"{'close' if ok else 'NOT close'} | {time.perf_counter() - t0:.0f} |")
        core.shutdown()


def iter_equal(a: list[int], b: list[int]):
    """The common greedy prefix of ``a`` and ``b``."""
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def first_divergence_close(a, b) -> bool:
    """vLLM's rule: at the first differing position each token is in the other's top-5."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x != y:
            return y in a.logprobs[i] and x in b.logprobs[i] and math.isfinite(
                a.logprobs[i][y].logprob)
    return True


if __name__ == "__main__":
    main()
