"""``tandem bench rate-limit``: how closely the router's per-API-key limits hold under load.

One tenant is limited to ``--tokens-per-minute`` (and optionally ``--requests-per-minute``)
through ``--api-keys``; ``--concurrency`` clients (httpx, async) send small requests with
its key to ``--replicas`` routers sharing one Redis (round robin, client i to replica
i mod n) for ``--duration-s``. A client refused with a 429 sleeps its ``Retry-After`` and
tries again; a 429 without one (the request exceeds the whole limit) stops that client.
Each admitted request's send time and usage (prompt + completion tokens, what the router
charges) are recorded; the report (``rate_limit_report``) gives, per sliding 60-s window
(stepped ``--window-step-s``, starting on whole seconds like the limiter's buckets) and
per fixed minute, the admitted tokens and requests against the limits (max, mean, the
share of windows over), the 429s, and the routers' per-tenant ``/metrics`` counters over
the load against the client's own count.

Without ``--url`` it starts the stack (``tandem.up.Stack``: redis-server, one colocated
engine, one router; then ``--replicas - 1`` more routers on the same Redis) with an
api-keys file it writes. With ``--url`` (repeatable) it drives routers already running:
give the limited key (``--api-key``), its tenant (``--tenant``) and its limits as the
routers' file sets them.

    tandem bench rate-limit --tokens-per-minute 6000 --concurrency 64 --duration-s 120
    tandem bench rate-limit --model /tmp/tiny --engine-arg=--dtype=float32 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.rate_limit_report import (
    Admitted,
    build_report,
    diff_totals,
    format_report,
    metric_totals,
    sum_totals,
)

#: The limited key and tenant the launched stack's api-keys file gives.
LAUNCH_KEY = "sk-bench-limited"
LAUNCH_TENANT = "bench-limited"
#: How long the routers' counters get to settle after the last answer (seconds), and
#: how often they are read meanwhile.
METRICS_SETTLE_S = 10.0
METRICS_POLL_S = 0.5


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench rate-limit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", default=[],
                   help="a running router's base URL (repeatable; default: start a stack)")
    p.add_argument("--api-key", default=None, help="with --url: the limited tenant's key")
    p.add_argument("--tenant", default=None, help="with --url: the key's tenant name")
    p.add_argument("--tokens-per-minute", type=int, required=True,
                   help="the tenant's token limit (tokens per minute)")
    p.add_argument("--requests-per-minute", type=int, default=None,
                   help="the tenant's request limit (requests per minute; default none)")
    p.add_argument("--replicas", type=int, default=2, choices=(1, 2),
                   help="routers the launched stack runs on its one Redis")
    p.add_argument("--model", default=None,
                   help="model folder or .gguf for the launched stack (default: the "
                        "default model); also the requests' model name")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra engine flag for the launched stack, e.g. "
                        "--engine-arg=--dtype=float32")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for the launched routers")
    p.add_argument("--concurrency", type=int, default=64, help="clients")
    p.add_argument("--duration-s", type=float, default=120.0,
                   help="seconds the clients send for (answers in flight are awaited)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="the door: /v1/completions or /v1/chat/completions")
    p.add_argument("--prompt", default="Write one sentence about the sea.",
                   help="every request's prompt (or user message)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--window-step-s", type=float, default=5.0,
                   help="step of the sliding 60-s windows (seconds)")
    p.add_argument("--json-out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    if args.url and not (args.api_key and args.tenant):
        p.error("--url: give the limited key's --api-key and --tenant too")
    if args.concurrency < 1:
        p.error(f"--concurrency: must be >= 1, got {args.concurrency}")
    if args.duration_s <= 0:
        p.error(f"--duration-s: must be > 0, got {args.duration_s}")
    return args


def keys_yaml(tokens_per_minute: int, requests_per_minute: int | None) -> str:
    """The launched stack's ``--api-keys`` file: the one limited tenant."""
    rpm = f", requests_per_minute: {requests_per_minute}" if requests_per_minute else ""
    return (f"{LAUNCH_KEY}: {{tenant: {LAUNCH_TENANT}, tokens_per_minute: "
            f"{tokens_per_minute}{rpm}}}\n")


def request_body(args: argparse.Namespace, model: str) -> tuple[str, dict[str, Any]]:
    """The path and JSON body every client sends (greedy, not streamed)."""
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": 0}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": args.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = args.prompt
    return "/v1/completions", body


class Load:
    """What the clients saw: admitted requests, 429 arrival times, other failures."""

    def __init__(self) -> None:
        self.admitted: list[Admitted] = []
        self.refused_s: list[float] = []
        self.errors: list[str] = []
        self.num_stopped = 0  # clients told their request can never fit


async def _client(http: Any, url: str, body: dict[str, Any], key: str, deadline_s: float,
                  load: Load) -> None:
    """One client: send, and on a 429 wait ``Retry-After``, until ``deadline_s`` (epoch)."""
    headers = {"Authorization": f"Bearer {key}"}
    while time.time() < deadline_s:
        sent_s = time.time()
        try:
            resp = await http.post(url, json=body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - any transport failure is one error
            load.errors.append(f"{type(exc).__name__}: {exc}")
            continue
        done_s = time.time()
        if resp.status_code == 200:
            usage = resp.json()["usage"]
            load.admitted.append(Admitted(sent_s, done_s, int(usage["prompt_tokens"]),
                                          int(usage["completion_tokens"])))
        elif resp.status_code == 429:
            load.refused_s.append(done_s)
            retry_after = resp.headers.get("retry-after")
            if retry_after is None:
                load.num_stopped += 1
                return
            await asyncio.sleep(max(0.0, min(float(retry_after), deadline_s - time.time())))
        else:
            load.errors.append(f"HTTP {resp.status_code}: {resp.text[:200]}")


async def run_load(urls: list[str], path: str, body: dict[str, Any], key: str,
                   concurrency: int, duration_s: float) -> tuple[Load, float, float]:
    """Drive the clients; (what they saw, start, end of sending) in epoch seconds. Returns
    once every answer in flight has arrived."""
    import httpx

    load = Load()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start_s = time.time()
        deadline_s = start_s + duration_s
        await asyncio.gather(*(_client(http, urls[i % len(urls)] + path, body, key,
                                       deadline_s, load) for i in range(concurrency)))
    return load, start_s, deadline_s


def read_totals(urls: list[str], tenant: str) -> dict[str, Any]:
    """The routers' counters for ``tenant``, summed over ``urls``."""
    import httpx

    pages = []
    for url in urls:
        resp = httpx.get(url + "/metrics", timeout=30.0)
        resp.raise_for_status()
        pages.append(metric_totals(resp.text, tenant))
    return sum_totals(pages)


def settled_totals(urls: list[str], tenant: str) -> dict[str, Any]:
    """``read_totals`` once two reads ``METRICS_POLL_S`` apart agree (a request's tokens
    are counted when it ends, just after its answer may have left), or after
    ``METRICS_SETTLE_S``."""
    last = read_totals(urls, tenant)
    give_up_s = time.monotonic() + METRICS_SETTLE_S
    while time.monotonic() < give_up_s:
        time.sleep(METRICS_POLL_S)
        now = read_totals(urls, tenant)
        if now == last:
            break
        last = now
    return last


def measure(args: argparse.Namespace, urls: list[str], key: str, tenant: str,
            model: str) -> dict[str, Any]:
    """One load against ``urls``; the report with its config."""
    path, body = request_body(args, model)
    before = read_totals(urls, tenant)
    load, start_s, end_s = asyncio.run(run_load(urls, path, body, key, args.concurrency,
                                                args.duration_s))
    router = diff_totals(settled_totals(urls, tenant), before)
    report = build_report(load.admitted, load.refused_s, len(load.errors), start_s, end_s,
                          args.window_step_s, args.tokens_per_minute,
                          args.requests_per_minute, router)
    report["config"] = {"replicas": len(urls), "concurrency": args.concurrency,
                        "duration_s": args.duration_s, "endpoint": args.endpoint,
                        "max_tokens": args.max_tokens, "model": model, "tenant": tenant}
    report["client"]["stopped_clients"] = load.num_stopped
    report["client"]["error_samples"] = sorted(set(load.errors))[:5]
    return report


def launch_and_measure(args: argparse.Namespace) -> dict[str, Any]:
    """Start the stack (see the module doc), measure, stop it."""
    from tandem.launch import Part, free_port, http_ok, tandem_argv
    from tandem.up import Stack, StackConfig

    with tempfile.TemporaryDirectory(prefix="tandem-bench-rate-limit-") as tmp:
        keys = Path(tmp) / "api-keys.yaml"
        keys.write_text(keys_yaml(args.tokens_per_minute, args.requests_per_minute))
        router_args = ["--api-keys", str(keys), *args.router_arg]
        cfg = StackConfig(colocated=True, port=0, grpc_port=0, model=args.model,
                          engine_args=list(args.engine_arg), router_args=router_args)
        with Stack(cfg) as stack:
            urls = [stack.http_url]
            for i in range(1, args.replicas):
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                argv = ["router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port",
                        "0", "--redis-url", stack.redis_url, *router_args]
                if args.model:
                    argv += ["--model", args.model]
                stack.launcher.launch([Part(f"router-{i}", tandem_argv(*argv),
                                            lambda u=url: http_ok(f"{u}/ready"), url)],
                                      cfg.startup_timeout_s)
                urls.append(url)
            model = served_model(urls[0], LAUNCH_KEY)
            print(f"== {len(urls)} router(s) {urls} over one colocated engine, model "
                  f"{model!r} ==", flush=True)
            return measure(args, urls, LAUNCH_KEY, LAUNCH_TENANT, model)


def served_model(url: str, key: str) -> str:
    """The first model ``url``'s ``/v1/models`` lists (asked with ``key``: a router with
    ``--api-keys`` answers only its keys)."""
    import httpx

    resp = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                     timeout=30.0)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.url:
        urls = [u.rstrip("/") for u in args.url]
        report = measure(args, urls, args.api_key, args.tenant,
                         args.model or served_model(urls[0], args.api_key))
    else:
        report = launch_and_measure(args)
    print(format_report(report), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
