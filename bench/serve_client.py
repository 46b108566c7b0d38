"""`tandem bench serve`'s load: random token-id prompts, the HTTP client, one streamed
request's measurements and the arrival process (a gamma process, Poisson for burstiness 1,
as ``vllm bench serve``)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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


async def stream_completion(client: Any, url: str, model: str, prompt: list[int],
                            max_tokens: int, ignore_eos: bool,
                            extra: dict[str, Any] | None = None,
                            temperature: float = 0.0) -> RequestResult:
    """One streamed ``/v1/completions`` request of ``prompt`` (token ids); a failure is
    recorded in the result, never raised."""
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
                return await stream_completion(client, url, model, p, o, ignore_eos, extra(o),
                                               temperature)
            async with sem:
                return await stream_completion(client, url, model, p, o, ignore_eos, extra(o),
                                               temperature)

        tasks = []
        start = time.perf_counter()
        for p, o in prompts:
            tasks.append(asyncio.create_task(guarded(p, o)))
            if request_rate != float("inf"):
                theta = 1.0 / (request_rate * burstiness)
                await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
