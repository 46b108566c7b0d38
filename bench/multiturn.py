"""The multi-turn chat workload of `tandem bench serve` (``--dataset-name multi-turn``).

``N`` conversations share one system prompt of ``S`` tokens; each has ``T`` turns. Turn
``t`` sends the system prompt, every earlier user message and answer, and a new user
message of ``U`` tokens through ``/v1/chat/completions`` (streamed), and asks for an
answer of ``A`` tokens (``ignore_eos``, so every answer has ``A`` tokens); the answer's
text goes into the next turn's history. Conversations start at ``--request-rate`` (gamma
arrivals, as the random dataset's requests) and run their turns back to back;
``--max-concurrency`` bounds the requests in flight. The same shape as vLLM's multi-round
QA benchmark and LMCache's long-document / multi-round QA (written anew).

Reported per turn: TTFT percentiles, the prompt length and the cached prompt tokens the
router reports (``usage.prompt_tokens_details.cached_tokens``, else ``timings.cached_tokens``). Turn 1 of every
conversation shares only the system prompt; from turn 2 on the history is reusable if
the serving side keeps (or, with the KV store as a shared tier, publishes) it.

Text is built from random token ids decoded with the model's tokenizer, so lengths are
close to, not exactly, the requested ones (the chat template and re-tokenisation add or
merge a few tokens).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.bench.serve import http_session, sse_events


@dataclass(frozen=True)
class MultiTurnShape:
    """What each conversation looks like (token counts before templating).

    Raises:
        ValueError: a count below 1 (``system_len`` may be 0), naming the flag.
    """

    num_conversations: int
    num_turns: int
    system_len: int
    user_len: int
    answer_len: int

    def __post_init__(self) -> None:
        for flag, value in (("--multi-turn-conversations", self.num_conversations),
                            ("--multi-turn-turns", self.num_turns),
                            ("--multi-turn-user-len", self.user_len),
                            ("--multi-turn-answer-len", self.answer_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.system_len < 0:
            raise ValueError(f"--multi-turn-system-len must be >= 0, got {self.system_len}")


@dataclass
class TurnResult:
    """One turn's measurements (seconds)."""

    conversation: int
    turn: int
    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""
    timings: dict[str, Any] = field(default_factory=dict)


def _text(rng: random.Random, tokenizer: Any, n: int) -> str:
    """About ``n`` tokens of text (random ids from 1000 up, decoded)."""
    vocab = len(tokenizer)
    return tokenizer.decode([rng.randrange(1000, vocab) for _ in range(n)],
                            skip_special_tokens=True)


def build_conversations(shape: MultiTurnShape, tokenizer: Any, seed: int
                        ) -> tuple[str, list[list[str]]]:
    """(the shared system prompt, each conversation's user messages in turn order)."""
    rng = random.Random(seed)
    system = _text(rng, tokenizer, shape.system_len) if shape.system_len else ""
    users = [[_text(rng, tokenizer, shape.user_len) for _ in range(shape.num_turns)]
             for _ in range(shape.num_conversations)]
    return system, users


def chat_body(model: str, messages: list[dict[str, str]], answer_len: int,
              skip_special_tokens: bool = False) -> dict[str, Any]:
    """The streamed ``/v1/chat/completions`` body of one turn.

    ``ignore_eos`` makes every answer ``answer_len`` tokens long, so the model often
    writes past its end of turn: an end-of-turn token and a made-up next turn (chat
    template markers, special tokens). With ``skip_special_tokens`` (the API's default)
    those tokens leave the text, the next turn's history does not re-tokenise to the
    ids the model generated, and the published blocks of the answer from that token on
    cannot match; so by default the answer's text keeps them (``False``), and the
    history is the token ids the decode instance computed.
    """
    return {"model": model, "messages": messages, "max_tokens": answer_len,
            "temperature": 0.0, "stream": True, "ignore_eos": True,
            "skip_special_tokens": skip_special_tokens,
            "stream_options": {"include_usage": True}}


async def _turn(client: Any, url: str, model: str, messages: list[dict[str, str]],
                answer_len: int, res: TurnResult, skip_special_tokens: bool = False
                ) -> None:
    body = chat_body(model, messages, answer_len, skip_special_tokens)
    start = time.perf_counter()
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:300]!r}"
                return
            async for data in sse_events(resp):
                if "error" in data:
                    res.error = str(data["error"].get("message"))
                    return
                usage = data.get("usage")
                if usage:
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = max(res.cached_tokens, details.get("cached_tokens") or 0)
                if data.get("timings"):
                    res.timings = data["timings"]
                    res.cached_tokens = max(res.cached_tokens,
                                            res.timings.get("cached_tokens") or 0)
                for choice in data.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if not res.ttft and (piece or choice.get("finish_reason")):
                        res.ttft = time.perf_counter() - start
                    res.text += piece
        res.latency = time.perf_counter() - start
        res.success = res.ttft > 0
    except Exception as exc:  # noqa: BLE001 - a failed turn is a measurement, not a crash
        res.error = f"{type(exc).__name__}: {exc}"


async def run_conversations(url: str | Sequence[str], model: str, shape: MultiTurnShape,
                            system: str,
                            users: list[list[str]], request_rate: float, burstiness: float,
                            max_concurrency: int | None, seed: int,
                            skip_special_tokens: bool = False
                            ) -> tuple[list[TurnResult], float]:
    """Run every conversation (turns in order; a failed turn ends its conversation).

    ``skip_special_tokens``: drop special tokens from the answers' text (see
    :func:`chat_body`; the default keeps them, so histories re-tokenise to the ids
    generated).

    ``url``: one endpoint, or one per router: turn ``t`` of conversation ``c`` then goes to
    ``url[(c + t) % len(url)]``, so a conversation's turns change router every turn.

    Returns (every turn's result, wall time in seconds).
    """
    urls = [url] if isinstance(url, str) else list(url)
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[TurnResult] = []
    async with http_session() as client:

        async def conversation(c: int) -> None:
            messages = [{"role": "system", "content": system}] if system else []
            for t, user in enumerate(users[c]):
                turn_url = urls[(c + t) % len(urls)]
                messages.append({"role": "user", "content": user})
                res = TurnResult(conversation=c, turn=t + 1)
                results.append(res)
                if sem is None:
                    await _turn(client, turn_url, model, messages, shape.answer_len, res,
                                skip_special_tokens)
                else:
                    async with sem:
                        await _turn(client, turn_url, model, messages, shape.answer_len, res,
                                    skip_special_tokens)
                if not res.success:
                    return
                messages.append({"role": "assistant", "content": res.text})

        tasks = []
        start = time.perf_counter()
        for c in range(shape.num_conversations):
            tasks.append(asyncio.create_task(conversation(c)))
            if request_rate != float("inf"):
                theta = 1.0 / (request_rate * burstiness)
                await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def turn_metrics(results: list[TurnResult], duration_s: float, percentiles: list[float]
                 ) -> dict[str, Any]:
    """Totals plus, per turn, TTFT percentiles (ms), mean prompt and cached tokens, and
    the median of each TTFT part the router reports (``median_<part>_ms``); ``requests``
    keeps every turn's own conversation, turn, success, prompt / cached / output tokens
    and TTFT (ms), in the order the turns were sent."""
    ok = [r for r in results if r.success]
    per_turn = []
    for turn in sorted({r.turn for r in results}):
        mine = [r for r in ok if r.turn == turn]
        row: dict[str, Any] = {"turn": turn, "completed": len(mine),
                               "failed": sum(1 for r in results if r.turn == turn
                                             and not r.success)}
        if mine:
            ttfts = np.array([r.ttft for r in mine]) * 1000
            row["mean_ttft_ms"] = float(ttfts.mean())
            for p in percentiles:
                key = "median_ttft_ms" if p == 50 else f"p{p:g}_ttft_ms"
                row[key] = float(np.percentile(ttfts, p))
            row["mean_prompt_tokens"] = float(np.mean([r.prompt_tokens for r in mine]))
            row["mean_cached_tokens"] = float(np.mean([r.cached_tokens for r in mine]))
            paths = [r.timings.get("disagg_decision") for r in mine]
            row["local_prefill"] = sum(1 for p in paths if p == "local_prefill")
            # Where the first token's time went: the router's TTFT parts, medians in ms
            # over the requests that have the part (a local prefill has no prefill_*).
            for part in _TTFT_PARTS:
                vals = [r.timings[part] for r in mine if r.timings.get(part) is not None]
                if vals:
                    row[f"median_{part[:-3]}_ms"] = float(np.median(vals)) / 1e6
        per_turn.append(row)
    return {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "per_turn": per_turn,
        "requests": [{"conversation": r.conversation, "turn": r.turn, "success": r.success,
                      "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                      "output_tokens": r.output_tokens, "ttft_ms": r.ttft * 1000}
                     for r in results],
        "errors": [r.error for r in results if r.error],
    }


#: The router's ``timings`` fields that make up a TTFT (ns), summarised per turn.
_TTFT_PARTS = ("router_queue_ns", "prefill_queue_ns", "prefill_compute_ns", "kv_publish_ns")


def print_turns(m: dict[str, Any], percentiles: list[float]) -> None:
    """The per-turn table."""
    print("{s:{c}^60}".format(s=" Multi-turn chat: TTFT per turn ", c="="))
    cols = {"turn": "turn", "completed": "done", "mean_prompt_tokens": "prompt tok",
            "mean_cached_tokens": "cached tok", "mean_ttft_ms": "TTFT mean ms"}
    for p in percentiles:
        cols["median_ttft_ms" if p == 50 else f"p{p:g}_ttft_ms"] = f"TTFT p{p:g} ms"
    for part, label in (("prefill_queue", "pf queue ms"), ("prefill_compute", "pf comp ms")):
        if any(f"median_{part}_ms" in row for row in m["per_turn"]):
            cols[f"median_{part}_ms"] = label
    print("  ".join(f"{label:>12}" for label in cols.values()))
    for row in m["per_turn"]:
        print("  ".join(f"{row.get(c, float('nan')):>12.1f}" if isinstance(row.get(c), float)
                        else f"{row.get(c, '-')!s:>12}" for c in cols))
    print(f"completed {m['completed']}, failed {m['failed']}, duration {m['duration']:.2f} s")
    print("=" * 60)


def plot_turns(runs: list[dict[str, Any]], path: str) -> None:
    """PNG of each run's median TTFT per turn (ms; whiskers to the p90 when measured) and
    of its mean cached share of the prompt per turn, one series per run ``label``.

    Args:
        runs: :func:`turn_metrics` results, each with a ``label``.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_cached) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        rows = [r for r in run["per_turn"] if "median_ttft_ms" in r]
        x = np.array([r["turn"] for r in rows], dtype=float) + (i - (len(runs) - 1) / 2) * width
        med = np.array([r["median_ttft_ms"] for r in rows])
        p90 = np.array([r.get("p90_ttft_ms", m) for r, m in zip(rows, med, strict=True)])
        label = run.get("label") or f"run {i + 1}"
        ax_ttft.bar(x, med, width, yerr=[np.zeros_like(med), p90 - med], capsize=3,
                    color=f"C{i}", label=label)
        ax_cached.bar(x, [100 * r["mean_cached_tokens"] / r["mean_prompt_tokens"]
                          for r in rows], width, color=f"C{i}", label=label)
    ax_ttft.set_title("median TTFT per turn (whisker: p90)")
    ax_ttft.set_ylabel("ms")
    ax_cached.set_title("prompt tokens cached (mean)")
    ax_cached.set_ylabel("%")
    turns = sorted({r["turn"] for run in runs for r in run["per_turn"]})
    for ax in (ax_ttft, ax_cached):
        ax.set_xticks(turns)
        ax.set_xlabel("turn")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
