"""`tandem bench serve`'s flags (``vllm bench serve``'s names where it has one) and the
SLO parser of ``--slo`` / ``--goodput``."""

from __future__ import annotations

import argparse

from tandem.bench.serve_doors import ENDPOINT_TYPES
from tandem.kvstore.config import parse_bytes


def parse_slo(items: list[str], sep: str) -> dict[str, float]:
    """``ttft=500,tpot=50`` or vLLM's ``ttft:500 tpot:50`` -> {metric: ms}.

    Args:
        items: the flag values, each one or more ``NAME<sep>MS`` joined by commas.
        sep: ``=`` (``--slo``) or ``:`` (``--goodput``).

    Raises:
        ValueError: a part that is not ``ttft``, ``tpot`` or ``e2el`` with a value.
    """
    out: dict[str, float] = {}
    for item in items:
        for part in item.split(","):
            if not part.strip():
                continue
            name, _, value = part.partition(sep)
            name = name.strip().lower()
            if name not in ("ttft", "tpot", "e2el") or not value:
                raise ValueError(f"SLO must look like ttft{sep}MS,tpot{sep}MS, got {part!r}")
            out[name] = float(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem bench serve",
        description="online serving load test against a running router (HTTP, SSE)")
    p.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                   help="router base URL")
    p.add_argument("--endpoint-type", nargs="+", default=["completions"],
                   choices=ENDPOINT_TYPES,
                   help="the door the load goes through (bench/serve_doors.py): completions "
                        "(token-id prompts), chat, responses (OpenAI Responses API) or "
                        "messages (Anthropic Messages API); the text doors get the random "
                        "ids' text and count the input tokens the router reports. Several: "
                        "each rate's load goes through each door in turn (fresh prompts per "
                        "door, the same lengths) and a table compares them")
    p.add_argument("--endpoint", default=None,
                   help="URL path (default: the --endpoint-type's, e.g. /v1/completions; "
                        "one --endpoint-type only)")
    p.add_argument("--model", default=None, help="model name (default: the router's first)")
    p.add_argument("--dataset-name", default="random", choices=["random", "multi-turn"],
                   help="random: token-id prompts; multi-turn: chat conversations whose "
                        "turns resend the history (bench/multiturn.py)")
    p.add_argument("--multi-turn-conversations", type=int, default=16,
                   help="multi-turn: conversations (they start at --request-rate)")
    p.add_argument("--multi-turn-turns", type=int, default=4, help="multi-turn: turns each")
    p.add_argument("--multi-turn-system-len", type=int, default=1000,
                   help="multi-turn: tokens of the system prompt all conversations share")
    p.add_argument("--multi-turn-user-len", type=int, default=64,
                   help="multi-turn: tokens of each user message")
    p.add_argument("--multi-turn-answer-len", type=int, default=64,
                   help="multi-turn: tokens of each answer (ignore_eos)")
    p.add_argument("--multi-turn-skip-special-tokens", action="store_true",
                   help="multi-turn: drop special tokens from the answers' text (the API's "
                        "default); by default they stay, so the next turn's history "
                        "re-tokenises to the ids generated even when an answer runs past "
                        "its end of turn")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--input-len-mix", default=None,
                   help="LEN:WEIGHT,... draw each input length from these (e.g. 64:0.8,2048:0.2)")
    p.add_argument("--request-rate", type=float, nargs="+", default=[float("inf")],
                   help="requests/s; several values run one after another")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true",
                   help="vLLM's ignore_eos on every request (completions and chat; the "
                        "responses and messages doors refuse it: --structured json forces "
                        "their output lengths)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy); "
                        "vllm bench serve sends none, so a server samples at its own "
                        "default: 1.0 for tandem and vLLM unless the model's "
                        "generation_config.json sets one")
    p.add_argument("--structured", choices=["json"], default=None,
                   help="constrain every request by a JSON schema (structured_outputs.json) "
                        "that no output of its length completes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="+", default=[], help="vLLM form: ttft:MS tpot:MS")
    p.add_argument("--slo", default="", help="ttft=MS,tpot=MS (same as --goodput)")
    p.add_argument("--tokenizer", default=None,
                   help="model path whose tokenizer sizes the vocabulary (default model if unset)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (default: from the model's tokenizer)")
    p.add_argument("--json", default=None, nargs="?", const="-",
                   help="write the result JSON to this file ('-' or no value: stdout)")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", default=None,
                   help="PNG of latency percentiles over request rate (multi-turn: median "
                        "TTFT and cached share per turn, per stack)")
    p.add_argument("--label", default=None, help="a name for this run (in the JSON)")
    p.add_argument("--launch", action="append", default=[],
                   choices=["disagg", "disagg-no-reuse", "colocated"],
                   help="start this stack (tandem up) for the run instead of using --url; "
                        "repeat to compare: --launch disagg --launch colocated; "
                        "disagg-no-reuse: engines neither load prompts' stored prefixes nor "
                        "publish finished outputs (the store only hands prompts from "
                        "prefill to decode)")
    p.add_argument("--launch-model", default=None, help="model for --launch")
    p.add_argument("--launch-engine-arg", action="append", default=[],
                   help="extra engine flag for --launch stacks, e.g. --launch-engine-arg="
                        "--max-num-batched-tokens=512")
    p.add_argument("--launch-router-arg", action="append", default=[],
                   help="extra flag for the launched router (repeatable), e.g. "
                        "--launch-router-arg=--disagg-min-uncached-tokens=64")
    p.add_argument("--launch-tracing", action="append", default=[],
                   choices=["off", "on", "down"],
                   help="OpenTelemetry tracing of the launched stacks, one stack per value "
                        "in order (repeat to alternate: --launch-tracing off "
                        "--launch-tracing on ...): off; on (every part exports to an OTLP "
                        "receiver in this process); down (an endpoint nobody serves: every "
                        "span dropped) (default: off)")
    p.add_argument("--launch-kvstore-tier", dest="launch_kvstore_tiers", action="append",
                   default=[], choices=["ram", "disk"],
                   help="the launched stacks' KV store, one stack per value in order (repeat "
                        "to alternate): ram (host RAM only); disk (with a disk tier under "
                        "--launch-kvstore-disk-path) (default: ram)")
    p.add_argument("--launch-kvstore-capacity", type=parse_bytes, default=0,
                   help="KV store RAM of the launched stacks (default: tandem up's)")
    p.add_argument("--launch-kvstore-disk-path", default=None,
                   help="folder of the disk tier of --launch-kvstore-tier disk stacks")
    p.add_argument("--launch-kvstore-disk-capacity", type=parse_bytes, default=0,
                   help="disk-tier bytes of --launch-kvstore-tier disk stacks")
    p.add_argument("--launch-kv-events", action="append", default=[], choices=["on", "off"],
                   help="the launched engines' KV events, one stack per value in order "
                        "(repeat to alternate): on (tandem up's default: the router's "
                        "kv_aware view is built from them); off (--no-kv-events: the router "
                        "guesses each engine's cache from what it sent) (default: on)")
    p.add_argument("--launch-routers", type=int, default=1, metavar="N",
                   help="routers of each launched stack, all on its Redis (multi-turn: a "
                        "conversation's turns rotate over them, so every turn meets another "
                        "router's view) (default 1)")
    p.add_argument("--launch-prefill", type=int, default=1,
                   help="prefill instances of a --launch disagg stack")
    p.add_argument("--launch-decode", type=int, default=1,
                   help="decode instances of a --launch disagg stack")
    p.add_argument("--fault", action="append", default=[], metavar="PART@SECONDS",
                   help="with --launch: also run the load with PART (decode-0, prefill-1, "
                        "kvstore, redis) killed SECONDS into it, restarted as tandem up "
                        "does, and compare (repeatable)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="with --launch: run each stack without and with this speculative "
                        "decoding config on its decode engines, side by side")
    p.add_argument("--profile", action="store_true",
                   help="with --launch: print each part's CPU seconds and, when py-spy is "
                        "installed, write a py-spy flame graph of the router and engines "
                        "(per-token decode attribution: the requests' traces, "
                        "--otlp-traces-endpoint)")
    p.add_argument("--profile-dir", default=".",
                   help="where --profile --launch writes the py-spy flame graphs")
    p.add_argument("--launch-disagg-cpus", type=int, default=0,
                   help="CPUs pinned to each of the prefill and decode engines (--launch "
                        "disagg); 0: unpinned, taking turns on the shared cores, as `tandem "
                        "up` starts them")
    return p
