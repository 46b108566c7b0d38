"""Batch-1 decode rate of the same model with and without on-load quantization.

Loads one ``LLM`` per ``--quantization`` value in this process (``none``: the checkpoint's
dtype, a ``.gguf`` dequantized at load; ``default``: no ``quantization`` argument; ``gguf``:
a ``.gguf`` on its blocks; ``int8`` / ``int4``: quantized on load), then runs ``--passes`` rounds; in each round every engine generates
``--output-len`` tokens greedily (EOS ignored) for one fresh random prompt of
``--input-len`` tokens, one engine after the other, so each engine's pass runs next
to the others' on a shared, noisy machine. Prints every pass's decode rate (output
tokens after the first per second after the first token's step) and each engine's
per-round ratio to the first engine.

    python -P -m tandem.bench.quant_decode --quantization none int8 int4 --passes 5
    python -P -m tandem.bench.quant_decode --quantization none gguf --passes 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams


def decode_rate(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Decode tokens per second of one request: the time of ``output_len`` tokens less
    that of one token on the same prompt (both prefix-cache hits after an untimed
    first request), over the ``output_len - 1`` decode steps that differ."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    full = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], one, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([prompt], one, use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate([prompt], full, use_tqdm=False)
    t2 = time.perf_counter()
    return (output_len - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments (see the module docstring), run, print."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: the LLM default)")
    p.add_argument("--quantization", nargs="+", default=["none", "int8"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.output_len < 2:
        raise ValueError(f"output_len must be >= 2, got {args.output_len}")
    engines = {
        q: LLM(model=args.model, dtype=args.dtype, quantization=None if q == "default" else q,
               max_num_seqs=1, seed=args.seed)
        for q in args.quantization
    }
    rng = random.Random(args.seed)
    for llm in engines.values():  # warm-up: kernel builds, first allocations
        llm.generate([[rng.randrange(1000, 20000) for _ in range(8)]],
                     SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    rates: dict[str, list[float]] = {q: [] for q in engines}
    for i in range(args.passes):
        prompt = [rng.randrange(1000, 20000) for _ in range(args.input_len)]
        row = []
        for q, llm in engines.items():
            rates[q].append(decode_rate(llm, prompt, args.output_len))
            row.append(f"{q} {rates[q][-1]:.1f}")
        first = next(iter(engines))
        ratios = " ".join(f"{q}/{first} {rates[q][-1] / rates[first][-1]:.2f}x"
                          for q in engines if q != first)
        print(f"pass {i}: " + ", ".join(row) + f" tok/s; {ratios}", flush=True)
    for q, r in rates.items():
        print(f"{q}: median {statistics.median(r):.1f} tok/s over {len(r)} passes "
              f"({', '.join(f'{v:.1f}' for v in r)})")


if __name__ == "__main__":
    main()
