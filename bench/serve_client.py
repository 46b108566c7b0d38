"""`tandem bench serve`'s load: random token-id prompts, the HTTP client, one streamed
request's measurements and the arrival process (a gamma process, Poisson for burstiness 1,
as ``vllm bench serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.bench.serve_doors import DOORS, Door, DoorError


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


async def stream_request(client: Any, url: str, door: Door, model: str,
                         prompt: list[int] | str, max_tokens: int, ignore_eos: bool,
                         extra: dict[str, Any] | None = None,
                         temperature: float = 0.0) -> RequestResult:
    """One streamed request of ``prompt`` (token ids, or text for a door that takes text)
    through ``door`` at ``url``, with ``extra`` fields added to the body; a failure is
    recorded in the result, never raised. TTFT and ITL are seconds to / between the door's
    token events; ``prompt_len`` is the door's reported input tokens for a text prompt."""
    res = RequestResult(prompt_len=len(prompt) if door.takes_ids else 0)
    body = {**door.body(model, prompt, max_tokens, temperature, ignore_eos), **(extra or {})}
    start = time.perf_counter()
    last = start
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return res
            async for data in sse_events(resp):
                text = door.read(data, res)
                if text is None:
                    continue
                now = time.perf_counter()
                if not res.ttft:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.generated_text += text
        res.latency = time.perf_counter() - start
        res.success = res.ttft > 0
    except DoorError as exc:
        res.error = str(exc)
    except Exception as exc:  # noqa: BLE001 - a failed request is a measurement, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def stream_completion(client: Any, url: str, model: str, prompt: list[int],
                            max_tokens: int, ignore_eos: bool,
                            extra: dict[str, Any] | None = None,
                            temperature: float = 0.0) -> RequestResult:
    """One streamed ``/v1/completions`` request of ``prompt`` (token ids): see
    :func:`stream_request`."""
    return await stream_request(client, url, DOORS["completions"], model, prompt, max_tokens,
                                ignore_eos, extra, temperature)


async def run_rate(url: str, model: str, prompts: Sequence[tuple[list[int] | str, int]],
                   request_rate: float, burstiness: float, max_concurrency: int | None,
                   ignore_eos: bool, seed: int, structured: str | None = None,
                   temperature: float = 0.0, door: Door | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` (``(prompt, max_tokens)``: token ids, or text for a door that takes
    text) through ``door`` (default: completions) with gamma-distributed gaps at
    ``request_rate`` req/s (inf: at once), each sampled at ``temperature`` (0: greedy).

    ``structured="json"``: every request carries vLLM's ``structured_outputs`` with the JSON
    schema of ``tandem bench throughput --structured json`` (no output of its
    ``max_tokens`` completes it, so constrained and unconstrained runs generate the same
    token counts).
    """
    door = door or DOORS["completions"]
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with http_session() as client:
        def extra(o: int) -> dict[str, Any] | None:
            if structured is None:
                return None
            from tandem.bench.throughput import structured_schema

            return {"structured_outputs": {"json": structured_schema(o)}}

        async def guarded(p: list[int] | str, o: int) -> RequestResult:
            async with sem or contextlib.nullcontext():
                return await stream_request(client, url, door, model, p, o, ignore_eos,
                                            extra(o), temperature)

        tasks = []
        start = time.perf_counter()
        for p, o in prompts:
            tasks.append(asyncio.create_task(guarded(p, o)))
            if request_rate != float("inf"):
                theta = 1.0 / (request_rate * burstiness)
                await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
