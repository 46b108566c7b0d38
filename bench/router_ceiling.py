"""`tandem bench router-ceiling`: what the router itself costs per streamed token.

The router is started in front of a decode stub (:class:`StubDecodeServicer`: the
DecodeService API, DecodeStream, streaming pre-made tokens, no model) and
loaded with streamed ``/v1/completions`` requests by ``tandem bench serve``'s client
(``serve.run_rate``), so everything measured is the router's path: gRPC in,
detokenization, stop strings, SSE out.

Two loads, each at ``--max-concurrency`` streams:

* ``--interval-ms 0``: the stub streams every token as fast as gRPC allows. Reported: the
  streamed tokens/s and the router's tokens per CPU second (its CPU time over the run,
  ``psutil``): the router's ceiling per core, whatever else shares the machine.
* ``--interval-ms MS`` (an engine's step time): the stub emits one token to every stream
  per tick, as an engine's step does. Reported: the client's p50/p99 inter-token latency
  against the stub's own tick intervals (the router's added jitter), and from the
  router's ``timings`` the per-token latency of gRPC hop, detokenization and SSE write.

The stub runs in its own process (``--serve-stub PORT``), so the router's CPU time is its
own; the load generator is a third process on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Plain English text: its tokens detokenize as ordinary words (no holdback surprises).
_TEXT = ("The quick brown fox jumps over the lazy dog while the router streams every "
         "token it receives to the client as soon as it can. ")


class StubDecodeServicer:
    """DecodeService with pre-made tokens: each stream carries ``max_tokens`` tokens (16
    when unset) cycling through ``token_ids``, finishing with ``length``, as the real
    servicer's messages.

    Args:
        token_ids: the tokens streamed, in a cycle (non-empty).
        interval_s: 0: each stream writes its tokens back to back (gRPC flow control is
            the only brake); > 0: a tick every ``interval_s`` releases one token to every
            open stream (an engine step).
        model: the model name GetLoad reports.
    """

    def __init__(self, token_ids: list[int], interval_s: float, model: str) -> None:
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        self._token_ids = token_ids
        self._interval_s = interval_s
        self._model = model
        self._tick: asyncio.Future[int] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._num_open = 0
        #: monotonic ns of each tick that released tokens (paced mode)
        self.tick_ns: list[int] = []

    async def _run_ticker(self) -> None:
        loop = asyncio.get_running_loop()
        next_t = loop.time()
        while True:
            next_t += self._interval_s
            await asyncio.sleep(max(0.0, next_t - loop.time()))
            tick, self._tick = self._tick, loop.create_future()
            if tick is not None and not tick.done():
                self.tick_ns.append(time.monotonic_ns())
                tick.set_result(0)

    async def _wait_tick(self) -> None:
        if self._tick is None:
            self._tick = asyncio.get_running_loop().create_future()
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._run_ticker())
        await asyncio.shield(self._tick)

    async def responses(self, request: Any) -> Any:
        """One request's ``DecodeResponse`` messages: ``max_tokens`` (default 16) of the
        stub's token ids, one per message, paced by the shared tick when an interval is
        set, the engine's first- and last-message fields filled."""
        from tandem.v1 import common_pb2, decode_pb2

        sp = request.sampling_params
        n = sp.max_tokens if sp.HasField("max_tokens") else 16
        ids = self._token_ids
        self._num_open += 1
        try:
            for i in range(n):
                if self._interval_s > 0:
                    await self._wait_tick()
                else:
                    # as one gRPC write per message does: the other streams go on
                    # between two tokens of this one (DecodeStream runs it as a task)
                    await asyncio.sleep(0)
                msg = decode_pb2.DecodeResponse(token_ids=[ids[i % len(ids)]])
                if i == 0:
                    msg.num_cached_tokens = 0
                    msg.queue_ns = 0
                if i == n - 1:
                    msg.finish_reason = common_pb2.FINISH_REASON_LENGTH
                yield msg
        finally:
            self._num_open -= 1

    async def DecodeStream(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        """Many requests' streams over one call (``services.decode.stream``)."""
        from tandem.services.decode.stream import serve_decode_stream

        async for resp in serve_decode_stream(request_iterator, self.responses):
            yield resp

    async def GetLoad(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
        from tandem.v1 import common_pb2

        return common_pb2.GetLoadResponse(num_running_requests=self._num_open, role="both",
                                          model=self._model, block_size=16,
                                          num_free_blocks=1 << 20, num_total_blocks=1 << 20)


async def serve_stub(port: int, token_ids: list[int], interval_s: float, model: str,
                     ticks_path: str | None = None) -> None:
    """Serve the stub on ``127.0.0.1:port`` until cancelled (SIGTERM/SIGINT); then write
    the tick times (ns, JSON list) to ``ticks_path`` when given."""
    import signal

    import grpc

    from tandem.v1 import decode_pb2_grpc

    servicer = StubDecodeServicer(token_ids, interval_s, model)
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)  # type: ignore[arg-type]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)
    if ticks_path:
        Path(ticks_path).write_text(json.dumps(servicer.tick_ns))


def _start(args: argparse.Namespace, interval_ms: float, tmp: Path, token_ids: list[int],
           model: str) -> tuple[Any, str, Any, Any]:
    """Start a stub and a router in front of it; (launcher, router URL, router part,
    stub part)."""
    import socket

    from tandem.launch import Launcher, Part, free_port, http_ok, tandem_argv

    stub_port, http_port = free_port(), free_port()

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", stub_port)) == 0

    stub = Part("stub", [sys.executable, "-P", "-m", "tandem.bench.router_ceiling",
                         "--serve-stub", str(stub_port), "--interval-ms", str(interval_ms),
                         "--token-ids", ",".join(map(str, token_ids)),
                         "--ticks-file", str(tmp / f"ticks-{interval_ms:g}.json"),
                         "--served-model", model], listening)
    url = f"http://127.0.0.1:{http_port}"
    router_argv = tandem_argv("router", "--colocated", f"127.0.0.1:{stub_port}", "--port",
                              str(http_port), "--grpc-port", "0", *args.router_arg)
    if args.router_python:
        router_argv[0] = args.router_python
    if args.model:
        router_argv += ["--model", args.model]
    router = Part("router", router_argv, lambda: http_ok(f"{url}/ready"))
    launcher = Launcher(tmp)
    launcher.launch([stub], 60)
    launcher.launch([router], 120)
    return launcher, url, router, stub


def _cpu_list(text: str) -> list[int]:
    """``"0,2"`` -> ``[0, 2]`` (argparse type; raises ValueError on anything else)."""
    cpus = [int(x) for x in text.split(",")]
    if not cpus or min(cpus) < 0:
        raise ValueError(text)
    return cpus


def _pin(cpus: list[int], router: Any, others: list[Any]) -> None:
    """Run ``router`` (a psutil.Process, its threads included) on ``cpus`` and ``others``
    (psutil.Process each) on the CPUs left.

    Raises:
        ValueError: a CPU not available to this process, or none left for the others.
    """
    allowed = set(router.cpu_affinity())
    rest = sorted(allowed - set(cpus))
    if not set(cpus) <= allowed or not rest:
        raise ValueError(f"--router-cpus {cpus}: needs CPUs of {sorted(allowed)} "
                         "with at least one left for the stub and the client")
    for thread in router.threads():
        os.sched_setaffinity(thread.id, cpus)
    router.cpu_affinity(cpus)
    for proc in others:
        for thread in proc.threads():
            os.sched_setaffinity(thread.id, rest)
        proc.cpu_affinity(rest)


def run_one(args: argparse.Namespace, interval_ms: float, token_ids: list[int], model: str,
            tmp: Path) -> dict[str, Any]:
    """One load against a fresh stub + router; the result dict (see the module doc)."""
    import psutil

    from tandem.bench.serve import compute_metrics, run_rate, sample_prompts

    launcher, url, router, stub = _start(args, interval_ms, tmp, token_ids, model)
    try:
        assert router.proc is not None and stub.proc is not None
        rproc, sproc = psutil.Process(router.proc.pid), psutil.Process(stub.proc.pid)
        if args.router_cpus is not None:
            _pin(args.router_cpus, rproc, [sproc, psutil.Process()])
        # a warm-up request: channels, the tokenizer's first use
        asyncio.run(run_rate(url + "/v1/completions", model, [([1000] * 8, 8)],
                             float("inf"), 1.0, None, True, 0))
        prompts = sample_prompts(args.num_prompts, args.input_len, args.output_len, 0.0,
                                 2000, args.seed)
        r0, s0 = sum(rproc.cpu_times()[:2]), sum(sproc.cpu_times()[:2])
        results, duration = asyncio.run(run_rate(
            url + "/v1/completions", model, prompts, float("inf"), 1.0,
            args.max_concurrency, True, args.seed))
        router_cpu = sum(rproc.cpu_times()[:2]) - r0
        stub_cpu = sum(sproc.cpu_times()[:2]) - s0
    finally:
        launcher.close()
    percentiles = [50.0, 99.0]
    m = compute_metrics(results, duration, percentiles, {})
    tokens = m["total_output_tokens"]
    out: dict[str, Any] = {
        "interval_ms": interval_ms, "max_concurrency": args.max_concurrency,
        "completed": m["completed"], "failed": m["failed"], "duration_s": duration,
        "output_throughput": m["output_throughput"], "router_cpu_s": router_cpu,
        "stub_cpu_s": stub_cpu,
        "router_tokens_per_cpu_s": tokens / router_cpu if router_cpu else None,
        "median_itl_ms": m["median_itl_ms"], "p99_itl_ms": m["p99_itl_ms"],
    }
    ticks_file = tmp / f"ticks-{interval_ms:g}.json"
    if interval_ms > 0 and ticks_file.exists():
        ticks = np.array(json.loads(ticks_file.read_text()), dtype=np.float64)
        gaps = np.diff(ticks) / 1e6
        if gaps.size:
            out["stub_median_tick_ms"] = float(np.median(gaps))
            out["stub_p99_tick_ms"] = float(np.percentile(gaps, 99))
            out["p99_itl_added_ms"] = out["p99_itl_ms"] - out["stub_p99_tick_ms"]
    return out


def print_one(r: dict[str, Any]) -> None:
    """One load's result, in words."""
    mode = "as fast as gRPC allows" if r["interval_ms"] == 0 else \
        f"one token per stream every {r['interval_ms']:g} ms"
    print(f"== stub: {mode}, {r['max_concurrency']} streams ==")
    print(f"completed / failed:                  {r['completed']} / {r['failed']}")
    print(f"streamed output tok/s:               {r['output_throughput']:.0f}")
    print(f"router CPU s / stub CPU s:           {r['router_cpu_s']:.2f} / "
          f"{r['stub_cpu_s']:.2f}")
    if r["router_tokens_per_cpu_s"]:
        print(f"router tokens per CPU second:        {r['router_tokens_per_cpu_s']:.0f}")
    print(f"client ITL median / p99 (ms):        {r['median_itl_ms']:.2f} / "
          f"{r['p99_itl_ms']:.2f}")
    if "stub_p99_tick_ms" in r:
        print(f"stub tick median / p99 (ms):         {r['stub_median_tick_ms']:.2f} / "
              f"{r['stub_p99_tick_ms']:.2f}")
        print(f"p99 ITL added (client - stub, ms):   {r['p99_itl_added_ms']:.2f}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench router-ceiling",
                                description=__doc__.splitlines()[0])
    p.add_argument("--interval-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="stub pacing per load: 0 = as fast as gRPC allows; MS = one token "
                        "per stream per MS (an engine step)")
    p.add_argument("--max-concurrency", type=int, default=64, help="concurrent streams")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=256, help="tokens streamed per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="the router's --model (its tokenizer)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for the router (repeatable)")
    p.add_argument("--router-python", default=None,
                   help="the interpreter that runs the router (default: this one); another "
                        "checkout's venv python compares two routers on the same stub")
    p.add_argument("--router-cpus", default=None, metavar="LIST", type=_cpu_list,
                   help="CPUs (comma-separated ids, e.g. 0) the router runs on; the stub "
                        "and the load generator then run on the others, so the client's "
                        "and the stub's own delays do not land in the router's (default: "
                        "all share)")
    p.add_argument("--json", default=None, help="write the results (a JSON list) here")
    # the stub process (started by the bench itself)
    p.add_argument("--serve-stub", type=int, default=None, metavar="PORT",
                   help=argparse.SUPPRESS)
    p.add_argument("--token-ids", default="", help=argparse.SUPPRESS)
    p.add_argument("--ticks-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--served-model", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem bench router-ceiling`. Returns 0 when every request of
    every load succeeded."""
    args = build_parser().parse_args(argv)
    if args.serve_stub is not None:
        ids = [int(x) for x in args.token_ids.split(",") if x]
        asyncio.run(serve_stub(args.serve_stub, ids, args.interval_ms[0] / 1000.0,
                               args.served_model, args.ticks_file))
        return 0
    if args.max_concurrency < 1 or any(x < 0 for x in args.interval_ms):
        print("tandem bench router-ceiling: error: --max-concurrency must be >= 1 and "
              "--interval-ms >= 0", file=sys.stderr)
        return 2
    import tempfile

    from tandem.engine.model_files import load_tokenizer, model_id_of

    tokenizer = load_tokenizer(args.model)
    token_ids = tokenizer.encode(_TEXT, add_special_tokens=False)
    results = []
    with tempfile.TemporaryDirectory(prefix="tandem-ceiling-") as tmp:
        for interval_ms in args.interval_ms:
            r = run_one(args, interval_ms, token_ids, model_id_of(args.model), Path(tmp))
            print_one(r)
            results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
