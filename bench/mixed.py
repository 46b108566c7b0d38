"""`tandem bench mixed`: short streams beside long prompts, against a running router.

Chat-like streams (short prompts, many output tokens each) run at a fixed concurrency
while other clients keep long prompts (RAG-like: thousands of prompt tokens, a few
output tokens) in flight for the whole run. It measures how a stack shares its compute
between prefill and decode under such a load: the streams' output tok/s and gaps
between tokens, and how long the long prompts wait for their first token. The run ends
when the last short stream ends; long requests still open then are cancelled and not
counted.

Output: ``vllm bench serve``-style results for each class (``print_result``), and with
``--json`` one file ``{"short": ..., "long": ..., "duration": s}`` whose class results
have ``bench.serve.compute_metrics``'s keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from tandem.bench.serve import (
    RequestResult,
    compute_metrics,
    http_session,
    model_and_vocab,
    print_result,
    sample_prompts,
)
from tandem.bench.serve_client import stream_completion


async def run_mixed(url: str, model: str, short: list[tuple[list[int], int]],
                    long: list[tuple[list[int], int]], short_concurrency: int,
                    long_concurrency: int) -> tuple[list[RequestResult], list[RequestResult],
                                                    float]:
    """Send every ``short`` prompt (at most ``short_concurrency`` at once) while
    ``long_concurrency`` clients send ``long`` prompts one after another (cycling); stop
    when the short ones are done.

    Args:
        url: the router's ``/v1/completions`` URL.
        short / long: ``(prompt token ids, max_tokens)`` pairs; every request is
            streamed, greedy, with ``ignore_eos``.

    Returns:
        (the short requests' results, the long requests that completed before the end,
        the run's duration in seconds).

    Raises:
        ValueError: a concurrency below 1 or an empty ``long`` list.
    """
    if short_concurrency < 1 or long_concurrency < 1:
        raise ValueError("short_concurrency and long_concurrency must be >= 1")
    if not long:
        raise ValueError("long: at least one long prompt is needed")
    async with http_session() as client:
        long_done: list[RequestResult] = []

        async def long_client(first: int) -> None:
            k = first
            while True:
                prompt, max_tokens = long[k % len(long)]
                k += long_concurrency
                long_done.append(await stream_completion(client, url, model, prompt,
                                                         max_tokens, True))

        sem = asyncio.Semaphore(short_concurrency)

        async def short_request(prompt: list[int], max_tokens: int) -> RequestResult:
            async with sem:
                return await stream_completion(client, url, model, prompt, max_tokens, True)

        start = time.perf_counter()
        clients = [asyncio.create_task(long_client(i)) for i in range(long_concurrency)]
        try:
            results = await asyncio.gather(*(short_request(p, o) for p, o in short))
        finally:
            duration = time.perf_counter() - start
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
    return list(results), long_done, duration


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench mixed", description=__doc__.split("\n")[0])
    p.add_argument("--url", "--base-url", default="http://127.0.0.1:8000", help="router base URL")
    p.add_argument("--model", default=None, help="model name (default: the router's first)")
    p.add_argument("--num-short", type=int, default=48, help="short streams in all")
    p.add_argument("--short-input-len", type=int, default=64)
    p.add_argument("--short-output-len", type=int, default=64)
    p.add_argument("--short-concurrency", type=int, default=8)
    p.add_argument("--long-input-len", type=int, default=3500)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-concurrency", type=int, default=2)
    p.add_argument("--tokenizer", default=None,
                   help="model path whose tokenizer sizes the vocabulary (default model if unset)")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the mixed load once; returns 1 when a short request failed, else 0.

    Raises:
        SystemExit: bad flags (argparse's usage error, exit 2).
    """
    p = build_parser()
    args = p.parse_args(argv)
    for flag in ("num_short", "short_input_len", "short_output_len", "short_concurrency",
                 "long_input_len", "long_output_len", "long_concurrency"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    percentiles = [float(x) for x in args.metric_percentiles.split(",")]
    base = args.url.rstrip("/")
    model, vocab = model_and_vocab(base, args.model, args.tokenizer, args.vocab_size)
    short = sample_prompts(args.num_short, args.short_input_len, args.short_output_len, 0.0,
                           vocab, args.seed)
    # distinct long prompts (no prefix-cache hits between them): enough for any run
    long = sample_prompts(64, args.long_input_len, args.long_output_len, 0.0, vocab,
                          args.seed + 1)
    results, long_done, duration = asyncio.run(run_mixed(
        f"{base}/v1/completions", model, short, long, args.short_concurrency,
        args.long_concurrency))
    out: dict[str, Any] = {"duration": duration}
    for name, res in (("short", results), ("long", long_done)):
        m = compute_metrics(res, duration, percentiles, {})
        print(f"\n{name} requests ({len(res)}):")
        print_result(m, percentiles, float("inf"))
        out[name] = {k: v for k, v in m.items()
                     if k not in ("generated_texts", "itls", "ttfts", "input_lens",
                                  "output_lens", "errors")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    failed = [r.error for r in results if not r.success]
    if failed:
        print(f"{len(failed)} short requests failed, the first: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
