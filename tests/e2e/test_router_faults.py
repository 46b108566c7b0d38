"""Routing, overload and faults: 2 prefill + 2 decode with a tiny random model.

One `tandem up`-style stack per module (tiny random-weight Llama, float32; redis from the
``redis_url`` fixture), plus a colocated engine behind a second router for the colocated
path and the bounded queue. Instances are killed for real (SIGKILL) while requests are in
flight: every request either completes or ends with an error event, none hangs, and new
requests go to the survivors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from ports import free_port
from waiting import wait_until

from tandem.launch import (
    Launcher,
    Part,
    grpc_serving,
    http_ok,
    redis_ok,
    tandem_argv,
    wait_ready,
)
from tandem.services.common.registry import KEY_PREFIX
from tandem.up import Stack, StackConfig
from tandem.v1 import common_pb2, prefill_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import metric_value, tiny_model_dir  # noqa: E402

# A short drain: a SIGTERM'd engine aborts what it did not finish in 1 s (then migrated).
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "512", "--max-model-len", "1024",
               "--shutdown-grace-s", "1"]
ROUTER_ARGS = ["--max-model-len", "1024"]
#: Client-side bound on any one request: a hang fails the test instead of blocking it.
REQUEST_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(tiny_model_dir(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def stack(tiny, redis_url):
    cfg = StackConfig(num_prefill=2, num_decode=2, port=0, grpc_port=0, model=tiny,
                      redis_url=redis_url, engine_args=ENGINE_ARGS, router_args=ROUTER_ARGS,
                      startup_timeout_s=600)
    with Stack(cfg) as s:
        yield s


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


async def _stream(http: httpx.AsyncClient, url: str, body: dict, events: list) -> str:
    """Stream one completion; returns "done", "error" (error event) or raises."""
    async with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}
                           ) as resp:
        assert resp.status_code == 200, await resp.aread()
        outcome = None
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                assert outcome is not None, "[DONE] without a finish_reason or an error"
                return outcome
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            events.append(data)
            if "error" in data:
                outcome = "error"
            elif data["choices"] and data["choices"][0]["finish_reason"]:
                outcome = "done"
    raise AssertionError("stream ended without [DONE]")


def test_kv_aware_routes_shared_prefix_to_same_prefill(stack) -> None:
    url, model = stack.http_url, _model(stack.http_url)
    prefix = list(range(1000, 1000 + 96))  # six full blocks
    seen = set()
    for tail in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        resp = httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                          json={"model": model, "prompt": prefix + tail, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        seen.add(resp.json()["timings"]["prefill_instance"])
    assert len(seen) == 1, f"one shared prefix went to several prefill instances: {seen}"


def test_requests_one_at_a_time_use_both_prefill_instances(stack) -> None:
    """Prompts without a shared prefix, one at a time (idle instances: every choice is a
    tie): the prefill choices rotate over both prefill instances (with one rotation for the
    prefill and the decode choice, every request's prefill went to the same instance)."""
    url, model = stack.http_url, _model(stack.http_url)
    seen = []
    for i in range(6):
        resp = httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": model, "prompt": [3000 + 100 * i + j for j in range(20)], "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        seen.append(resp.json()["timings"]["prefill_instance"])
    assert set(seen) == {stack.part("prefill-0").url, stack.part("prefill-1").url}, seen


def test_concurrent_requests_spread_over_decode_instances(stack) -> None:
    url, model = stack.http_url, _model(stack.http_url)

    async def run() -> set[str]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            resps = await asyncio.gather(*(http.post(f"{url}/v1/completions", json={
                "model": model, "prompt": [100 + i, 200, 300], "max_tokens": 64,
                "ignore_eos": True}) for i in range(8)))
        assert all(r.status_code == 200 for r in resps)
        return {r.json()["timings"]["decode_instance"] for r in resps}

    assert len(asyncio.run(run())) == 2


def _streams_through_a_fault(url: str, bodies: list[dict], fault) -> list[list[dict]]:
    """Stream ``bodies`` at once; call ``fault()`` once every stream produced tokens (all
    are in flight on decode instances); return each stream's events. Every stream must
    end with its finish_reason and usage (none with an error event)."""
    events: list[list] = [[] for _ in bodies]

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            tasks = [asyncio.create_task(_stream(
                http, url, {**b, "stream_options": {"include_usage": True}}, events[i]))
                for i, b in enumerate(bodies)]
            deadline = time.monotonic() + REQUEST_TIMEOUT_S
            while not all(len(e) >= 2 for e in events):
                assert time.monotonic() < deadline, "streams did not start"
                await asyncio.sleep(0.05)
            fault()
            return list(await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S))

    outcomes = asyncio.run(run())
    assert outcomes == ["done"] * len(bodies), [e[-1] for e in events]
    want = [b["max_tokens"] for b in bodies]
    assert [e[-1]["usage"]["completion_tokens"] for e in events] == want
    return events


def _final(events: list[dict]) -> dict:
    return next(c for c in events if c["choices"] and c["choices"][0]["finish_reason"])


def _text(events: list[dict]) -> str:
    return "".join(c["choices"][0]["text"] for c in events if c.get("choices"))


def test_decode_drained_or_killed_mid_stream_its_streams_complete(stack) -> None:
    """8 streams (4 greedy, 4 seeded sampled) run on both decode instances while one is
    stopped: first SIGTERM to decode-1 (it drains: stops admitting, finishes what it can
    in its 1 s grace, aborts the rest, which the router migrates), then, with decode-1
    back, SIGKILL to decode-0 (the router migrates its streams). Every stream ends as an
    uninterrupted run on one instance does: the same text, no token repeated or missing,
    usage counted once."""
    url, model = stack.http_url, _model(stack.http_url)
    bodies = [{"model": model, "prompt": [300 + i, 7], "max_tokens": 300, "ignore_eos": True,
               **({"temperature": 0} if i < 4 else {"temperature": 1.0, "seed": 40 + i})}
              for i in range(8)]

    drained = stack.part("decode-1")
    drain_events = _streams_through_a_fault(
        url, bodies, lambda: drained.proc.send_signal(signal.SIGTERM))
    assert drained.proc.wait(timeout=60) == 0, "a drained engine exits 0"
    assert all(_final(e)["timings"]["decode_instance"] != drained.url for e in drain_events
               if _final(e)["timings"].get("num_migrations"))
    stack.launcher.restart(drained)
    wait_ready([drained], 300)

    def served_by_drained() -> bool:
        r = httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": model, "prompt": [9, 9], "max_tokens": 2, "ignore_eos": True})
        return r.status_code == 200 and r.json()["timings"]["decode_instance"] == drained.url

    wait_until(served_by_drained, 120, "a request served by decode-1 again")

    victim = stack.part("decode-0")
    kill_events = _streams_through_a_fault(
        url, bodies, lambda: victim.proc.send_signal(signal.SIGKILL))
    migrated = [_final(e)["timings"].get("num_migrations", 0) for e in kill_events]
    assert any(migrated), "no stream was in flight on the killed instance"
    assert all(_final(e)["timings"]["decode_instance"] != victim.url for e in kill_events)

    # The reference: the same requests, uninterrupted, on the survivor.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                           timeout=REQUEST_TIMEOUT_S)
    for i, body in enumerate(bodies):
        ref = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                        extra_body={"ignore_eos": True})
        assert ref.model_extra["timings"]["decode_instance"] == drained.url
        assert _text(drain_events[i]) == ref.choices[0].text, f"drain: stream {i}"
        assert _text(kill_events[i]) == ref.choices[0].text, f"kill: stream {i} ({migrated[i]})"


def _num_unfinished(address: str) -> int:
    """Requests running or waiting on the prefill instance at ``address`` (its GetLoad)."""
    with grpc.insecure_channel(address) as ch:
        load = prefill_pb2_grpc.PrefillServiceStub(ch).GetLoad(common_pb2.GetLoadRequest(),
                                                                timeout=10)
    return load.num_running_requests + load.num_waiting_requests


def _port(url: str) -> int:
    """The port of ``http://127.0.0.1:PORT`` (the router serves /metrics there)."""
    return int(url.rsplit(":", 1)[1])


def _router_busy(url: str, n: int) -> bool:
    """At least ``n`` requests are past the router's admission and not finished."""
    return metric_value(_port(url), "tandem:router_num_requests_running") >= n


def _fault_under_load(url: str, bodies: list[dict], fault, busy) -> list[httpx.Response]:
    """Send ``bodies`` at once; run ``fault()`` as soon as ``busy()`` says there is work in
    flight; return the responses, which must all be 200s.

    NOTE: ``fault`` runs on this (the main) thread, though it blocks the client's event
    loop for its duration: a process it starts (redis restarted) would otherwise be a
    child of a worker thread, and tandem.child's parent-death signal (PR_SET_PDEATHSIG)
    fires when that thread ends, killing it after the test."""
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            tasks = [asyncio.create_task(http.post(f"{url}/v1/completions", json=b))
                     for b in bodies]
            await asyncio.to_thread(wait_until, busy, REQUEST_TIMEOUT_S, "work in flight", 0.002)
            fault()
            return list(await asyncio.gather(*tasks))

    resps = asyncio.run(asyncio.wait_for(run(), REQUEST_TIMEOUT_S))
    assert [r.status_code for r in resps] == [200] * len(bodies), [r.text for r in resps]
    return resps


def _kill_under_load(url: str, bodies: list[dict], victim, busy) -> list[httpx.Response]:
    """``_fault_under_load`` with SIGKILL of the part ``victim`` as the fault."""
    def kill() -> None:
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=30)

    return _fault_under_load(url, bodies, kill, busy)


def test_prefill_killed_under_load_requests_retry_on_survivor(stack) -> None:
    """SIGKILL a prefill instance while it holds several of 12 long prompts: they are
    retried on the other prefill instance, and every request ends with the text it would
    have had."""
    url, model = stack.http_url, _model(stack.http_url)
    victim = stack.part("prefill-0")
    retries = metric_value(_port(url), "tandem:router_request_retries_total", stage="prefill")
    # distinct first tokens: nothing is prefix-cached, each prefill computes 900 tokens
    bodies = [{"model": model, "prompt": [500 + i, *range(1000, 1900)], "max_tokens": 4,
               "temperature": 0} for i in range(12)]
    resps = _kill_under_load(url, bodies, victim,
                             lambda: _num_unfinished(victim.url) >= 3)
    retried = metric_value(_port(url), "tandem:router_request_retries_total", stage="prefill")
    assert retried > retries
    for body, resp in zip(bodies, resps, strict=True):
        ref = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert resp.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]


def test_redis_killed_under_load_requests_keep_their_text(stack, redis_server) -> None:
    """SIGKILL redis (the instance registry and the store's index) while prompts are being
    prefilled and handed over, and start it again empty on its port: the requests in flight
    complete, the engines register again and the stack serves again within 30 s, and
    every request ends with its reference text (blocks whose index entries are gone are
    recomputed)."""
    url, model = stack.http_url, _model(stack.http_url)
    bodies = [{"model": model, "prompt": [700 + i, *range(3000, 3400)], "max_tokens": 16,
               "temperature": 0, "ignore_eos": True} for i in range(8)]
    resps = _fault_under_load(url, bodies, redis_server.restart, lambda: _router_busy(url, 6))
    # The registry came back empty: each live engine's next heartbeat registers it again;
    # meanwhile the router keeps the engines that answer its load polls (discovery's grace
    # for a registry restart). The stack must serve again within 30 s.
    engines = [p for p in stack.parts if p.name.startswith(("prefill-", "decode-"))
               and p.alive()]
    registry = redis.Redis.from_url(redis_server.url)
    wait_until(lambda: len(list(registry.scan_iter(match=f"{KEY_PREFIX}:*"))) == len(engines),
               30, "the live engines registered again")

    def serves() -> bool:
        return httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": model, "prompt": [9, 9], "max_tokens": 2}).status_code == 200

    wait_until(serves, 30, "the stack serving again")
    for body, resp in zip(bodies, resps, strict=True):
        ref = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert ref.status_code == 200, ref.text
        assert resp.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        assert resp.json()["usage"]["completion_tokens"] == 16
    # The session's redis, which later modules use, is the one restarted here: it must
    # outlive this test (it once died with the thread that had started it).
    assert redis_server.proc is not None and redis_server.proc.poll() is None
    assert redis_ok(redis_server.url)


def test_kvstore_killed_under_load_requests_keep_their_text(stack) -> None:
    """SIGKILL the KV store node while prompts are being prefilled and handed over: blocks
    that cannot be published or loaded are recomputed, so every request still ends with the
    text it has without the store."""
    url, model = stack.http_url, _model(stack.http_url)
    bodies = [{"model": model, "prompt": [600 + i, *range(2000, 2400)], "max_tokens": 16,
               "temperature": 0, "ignore_eos": True} for i in range(8)]
    resps = _kill_under_load(url, bodies, stack.part("kvstore"), lambda: _router_busy(url, 6))
    for body, resp in zip(bodies, resps, strict=True):
        ref = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert ref.status_code == 200, ref.text
        assert resp.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        assert resp.json()["usage"]["completion_tokens"] == 16


@pytest.fixture(scope="module")
def colocated(tiny, tmp_path_factory):
    """A colocated engine behind its own router with a queue of 0 and 1 running slot."""
    tmp = tmp_path_factory.mktemp("colocated")
    eng_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = Launcher(tmp)
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            *ENGINE_ARGS), lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        router = Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--model", tiny, "--colocated", f"127.0.0.1:{eng_port}",
            "--max-running-requests", "1", "--max-queued-requests", "0", *ROUTER_ARGS),
            lambda: http_ok(f"{url}/ready"))
        launcher.launch([router], 300)
        yield url
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=30)


def test_colocated_matches_disaggregated(stack, colocated) -> None:
    prompt = [1234, 2345, 3456, 4567, 5678]
    texts = []
    for url in (stack.http_url, colocated):
        resp = httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S, json={
            "model": _model(url), "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


def test_full_queue_is_503_with_retry_after(colocated) -> None:
    model = _model(colocated)
    body = {"model": model, "prompt": [42, 43], "max_tokens": 800, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        with http.stream("POST", f"{colocated}/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            # The one running slot is taken and the queue holds 0: the next gets 503.
            resp = http.post(f"{colocated}/v1/completions",
                             json={"model": model, "prompt": [1, 2], "max_tokens": 2})
            assert resp.status_code == 503, resp.text
            assert resp.headers["Retry-After"] == "1"
            assert resp.json()["error"]["type"] == "service_unavailable_error"
        # The first stream closed (client gone): its slot frees and requests pass again.
        wait_until(lambda: http.post(f"{colocated}/v1/completions", json={
            "model": model, "prompt": [1, 2], "max_tokens": 2}).status_code == 200,
            60, "the slot to free after the disconnect")


def _launch_tandem_up(tiny: str, tmp_path: Path, *, sigint_ignored: bool = False,
                      ) -> tuple[subprocess.Popen, int]:
    """Start `tandem up --colocated` on free ports with its temp dir under ``tmp_path``;
    ``sigint_ignored``: through ``sh`` with SIGINT ignored, as in a background job of a
    script (``tandem up &``). No preexec_fn: this process may have used gRPC, and a fork
    then can abort the child (see tandem/child.py)."""
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, TMPDIR=str(tmp_path))
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-P", "-m", "tandem.cli", "up", "--colocated", "--model", tiny,
            "--port", str(port), "--grpc-port", str(grpc_port), "--log-dir", str(log_dir),
            *[f"--engine-arg={a}" for a in ENGINE_ARGS], "--router-arg=--max-model-len=1024"]
    if sigint_ignored:
        argv = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)
    return proc, port


def _wait_tandem_up_ready(proc: subprocess.Popen, port: int) -> None:
    def ready() -> bool:
        assert proc.poll() is None, proc.stdout.read()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 300, "tandem up ready")


@contextlib.contextmanager
def _tandem_up_ready(tiny: str, tmp_path: Path, *, sigint_ignored: bool = False,
                     ) -> Iterator[tuple[subprocess.Popen, int]]:
    """``_launch_tandem_up`` until ready: (process, HTTP port); killed on the way out if
    the test left it running."""
    proc, port = _launch_tandem_up(tiny, tmp_path, sigint_ignored=sigint_ignored)
    try:
        _wait_tandem_up_ready(proc, port)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _assert_stack_gone(children: list, tmp_path: Path) -> None:
    """Every child of `tandem up` exited (zombies count as gone) and its temp dir is removed."""
    import psutil

    wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE
                              for c in children), 30, "children to exit")
    assert not list(tmp_path.glob("tandem-up-*")), "temp dir left behind"


def test_tandem_up_sigterm_stops_everything(tiny, tmp_path) -> None:
    """`tandem up --colocated`: own redis-server, healthy, then SIGTERM leaves nothing."""
    import psutil

    with _tandem_up_ready(tiny, tmp_path) as (proc, port):
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "router" in names and "--role both" in names
        assert list(tmp_path.glob("tandem-up-*")), "the stack's temp dir exists while it runs"
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": _model(f"http://127.0.0.1:{port}"), "prompt": [5, 6, 7], "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _assert_stack_gone(children, tmp_path)


def test_tandem_up_sigint_with_inherited_sig_ign_stops_everything(tiny, tmp_path) -> None:
    """Bug (H9): `tandem up` started from a script (`tandem up &`: SIGINT is ignored in
    every background job of a non-interactive shell) kept running on SIGINT (`kill -INT`,
    Ctrl-C): Python leaves an inherited SIG_IGN in place.

    NOTE: SIGINT is sent once the stack is ready. Sent in the middle of start-up it once
    hung `tandem up` (seen in one CI-like run; a KeyboardInterrupt landing inside a child's
    spawn), which is listed as an open problem rather than pinned by a racy test.
    """
    import psutil

    with _tandem_up_ready(tiny, tmp_path, sigint_ignored=True) as (proc, _port):
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert kids, "tandem up started no children"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
        _assert_stack_gone(kids, tmp_path)


class _Output:
    """Every line a process writes, read on a thread (the test polls what arrived)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.lines: list[str] = []
        assert proc.stdout is not None
        stdout = proc.stdout
        self._thread = threading.Thread(target=lambda: self.lines.extend(stdout), daemon=True)
        self._thread.start()

    def has(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))


def test_tandem_up_restarts_a_killed_engine_and_redis(tiny, tmp_path) -> None:
    """Each part SIGKILLed under `tandem up` is started again (it used to take the whole
    stack down), says so, and the stack serves again; the killed run's log is kept."""
    import psutil

    proc, port = _launch_tandem_up(tiny, tmp_path)
    try:
        out = _Output(proc)
        wait_until(lambda: out.has("Press Ctrl-C to stop."), 300, "tandem up ready")
        url = f"http://127.0.0.1:{port}"
        model = _model(url)

        def serves() -> bool:
            assert proc.poll() is None, "".join(out.lines)
            try:
                return httpx.post(f"{url}/v1/completions", timeout=30, json={
                    "model": model, "prompt": [5, 6, 7], "max_tokens": 3}).status_code == 200
            except httpx.HTTPError:
                return False

        assert serves()
        for name, marker in (("colocated-0", "--role both"), ("redis", "redis-server")):
            (victim,) = [c for c in psutil.Process(proc.pid).children(recursive=True)
                         if marker in " ".join(c.cmdline()) and "child.py" not in
                         " ".join(c.cmdline())]
            victim.kill()
            wait_until(lambda n=name: out.has(f"{n} exited with code -9"), 30, f"{name} exit")
            wait_until(lambda n=name: out.has(f"{n} is back"), 300, f"{name} back")
            wait_until(serves, 30, f"the stack to serve after {name} came back")
            assert (tmp_path / "logs" / f"{name}.log.1").exists()
        assert proc.poll() is None, "tandem up must keep running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
