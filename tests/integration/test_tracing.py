"""One trace per request across every process (issue 41): router, prefill, KV store node
and decode export OTLP spans to a real receiver in the test (``bench/otlp_receiver.py``, which
decodes them with opentelemetry-proto's own classes); tracing off starts no exporter;
an endpoint that is down costs requests nothing and counts the spans it drops.

Real processes throughout: redis-server, `tandem kvstore`, `tandem serve --role prefill`
and `--role decode` on the tiny random Llama, and `tandem router`s over them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from ports import free_port
from services_harness import EngineService, Proc, metric_value, random_prompt
from waiting import wait_until

from tandem.bench.otlp_receiver import OTLPReceiver, ReceivedSpan
from tandem.launch import http_ok

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "128", "--block-size", "16"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
# The SDK's own settings (read by it in each process): export within 0.1 s, and give a
# dead endpoint 1 s before its batch counts as dropped.
OTEL_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "1"}


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced(tiny, redis_url, receiver, tmp_path_factory):
    """Store node, prefill and decode exporting to ``receiver``: (prefill, decode)."""
    tmp = tmp_path_factory.mktemp("tracing")
    trace_flags = ["--otlp-traces-endpoint", receiver.endpoint]
    saved = {k: os.environ.get(k) for k in OTEL_ENV}
    os.environ.update(OTEL_ENV)  # the children inherit it (Proc, EngineService)
    parts: list = []
    try:
        port, metrics_port = free_port(), free_port()
        node = Proc(
            [
                "kvstore",
                "--listen",
                f"127.0.0.1:{port}",
                "--capacity",
                str(64 << 20),
                "--redis-url",
                redis_url,
                "--metrics-port",
                str(metrics_port),
                *trace_flags,
            ],
            tmp / "kvstore.log",
            ready=lambda: http_ok(f"http://127.0.0.1:{metrics_port}/health"),
        )
        parts.append(node)
        node.wait_ready(120)
        for role in ("prefill", "decode"):
            parts.append(
                EngineService(
                    role, tiny, tmp, redis_url, [*ENGINE_ARGS, *trace_flags], startup_timeout_s=0
                )
            )
        for svc in parts[1:]:
            svc.wait_ready()
        yield parts[1], parts[2], tmp
    finally:
        for part in reversed(parts):
            part.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _router(
    tiny: str, prefill: EngineService, decode: EngineService, tmp: Path, extra: list[str]
) -> tuple[str, int, subprocess.Popen]:
    """A `tandem router` over ``prefill`` and ``decode`` with a thread probe: once the
    file ``<tmp>/probe-<port>`` exists, the process writes its thread names and whether
    the OpenTelemetry SDK is imported to ``<tmp>/probe-<port>.json``. (url, port, proc)."""
    port = free_port()
    code = (
        "import json, sys, threading, pathlib\n"
        "flag, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])\n"
        "def probe():\n"
        "    while not flag.exists():\n"
        "        threading.Event().wait(0.05)\n"
        "    out.write_text(json.dumps({'threads': [t.name for t in threading.enumerate()],\n"
        "        'sdk': any(m.startswith('opentelemetry.sdk') for m in sys.modules)}))\n"
        "threading.Thread(target=probe, name='probe', daemon=True).start()\n"
        "from tandem.cli import main\n"
        "sys.exit(main(sys.argv[3:]))\n"
    )
    args = [
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--model",
        tiny,
        "--prefill",
        prefill.address,
        "--decode",
        decode.address,
        *extra,
    ]
    log = (tmp / f"router-{port}.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-c",
            code,
            str(tmp / f"probe-{port}"),
            str(tmp / f"probe-{port}.json"),
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **OTEL_ENV},
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: proc.poll() is not None or http_ok(f"{url}/ready"), 120, "router")
    assert proc.poll() is None, (tmp / f"router-{port}.log").read_text()[-3000:]
    return url, port, proc


def _probe(tmp: Path, port: int) -> dict:
    (tmp / f"probe-{port}").touch()
    out = tmp / f"probe-{port}.json"
    wait_until(out.exists, 30, "the router's thread probe")
    return json.loads(out.read_text())


def _complete(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> dict:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    resp = httpx.post(
        f"{url}/v1/completions",
        headers=headers or {},
        timeout=120,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def test_one_request_is_one_trace_across_router_prefill_store_and_decode(tiny, traced, receiver):
    prefill, decode, tmp = traced
    url, port, proc = _router(
        tiny, prefill, decode, tmp, ["--otlp-traces-endpoint", receiver.endpoint]
    )
    try:
        prompt = random_prompt(41, 40)  # two full blocks and a partial one
        body = _complete(url, prompt, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert body["usage"]["completion_tokens"] == 6
        assert _probe(tmp, port)["sdk"], "tracing on loads the SDK"

        want = {
            ("tandem-router", "tandem.request"),
            ("tandem-router", "tandem.router_queue"),
            ("tandem-router", "tandem.prefill"),
            ("tandem-router", "tandem.decode_stream"),
            ("tandem-prefill", "tandem.prefill"),
            ("tandem-prefill", "tandem.kv_publish"),
            ("tandem-prefill", "tandem.prefill_queue"),
            ("tandem-prefill", "tandem.prefill_compute"),
            ("tandem-kvstore", "tandem.kvstore.put"),
            ("tandem-decode", "tandem.decode"),
            ("tandem-decode", "tandem.kv_pull"),
            ("tandem-decode", "tandem.decode_queue"),
            ("tandem-decode", "tandem.first_decode_step"),
        }

        def mine() -> dict[tuple[str, str], ReceivedSpan] | None:
            got = {(s.service, s.name): s for s in receiver.spans() if s.trace_id == TRACE_ID}
            return got if want <= set(got) else None

        spans = wait_until(mine, 60, "every process's spans of the request")
    finally:
        _stop(proc)

    def parent(service: str, name: str) -> str:
        return spans[(service, name)].parent_span_id

    def sid(service: str, name: str) -> str:
        return spans[(service, name)].span_id

    assert parent("tandem-router", "tandem.request") == CLIENT_SPAN
    root = sid("tandem-router", "tandem.request")
    for name in ("tandem.router_queue", "tandem.prefill", "tandem.decode_stream"):
        assert parent("tandem-router", name) == root, name
    # the engines' server spans are children of the router's calls to them
    assert parent("tandem-prefill", "tandem.prefill") == sid("tandem-router", "tandem.prefill")
    assert parent("tandem-decode", "tandem.decode") == sid("tandem-router", "tandem.decode_stream")
    prefill_span = sid("tandem-prefill", "tandem.prefill")
    for name in ("tandem.prefill_queue", "tandem.prefill_compute", "tandem.kv_publish"):
        assert parent("tandem-prefill", name) == prefill_span, name
    # the store node's put of the prompt's blocks joins the prefill's span
    put = spans[("tandem-kvstore", "tandem.kvstore.put")]
    assert put.parent_span_id == prefill_span
    assert put.attributes["tandem.kv.blocks"] >= 2 and put.attributes["tandem.kv.bytes"] > 0
    decode_span = spans[("tandem-decode", "tandem.decode")]
    for name in ("tandem.kv_pull", "tandem.decode_queue", "tandem.first_decode_step"):
        assert parent("tandem-decode", name) == decode_span.span_id, name
    pull = spans[("tandem-decode", "tandem.kv_pull")].attributes
    assert pull["tandem.kv.bytes"] > 0 and pull["tandem.kv.tier"] == "store"
    # the per-token attribution, summed per stream on both sides of it: 5 decode tokens
    # (the prefill made the first), each step's and message's share
    engine = decode_span.attributes
    assert engine["tandem.stream.engine_outputs"] == 5
    assert engine["tandem.stream.engine_decode_ns"] > 0
    assert (
        engine["tandem.stream.output_latency_ns"]
        >= engine["tandem.stream.max_output_latency_ns"]
        >= 0
    )
    router = spans[("tandem-router", "tandem.decode_stream")].attributes
    assert router["tandem.stream.tokens"] == 5 and router["tandem.stream.messages"] >= 1
    assert router["tandem.stream.detokenize_ns"] > 0
    assert spans[("tandem-router", "tandem.request")].attributes["gen_ai.usage.input_tokens"] == 40


def test_tracing_off_starts_no_exporter_and_loads_no_sdk(tiny, traced):
    prefill, decode, tmp = traced
    url, port, proc = _router(tiny, prefill, decode, tmp, [])
    try:
        _complete(url, random_prompt(42, 20), {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        probe = _probe(tmp, port)
        text = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        _stop(proc)
    assert not probe["sdk"], "tracing off must not import the OpenTelemetry SDK"
    assert not [t for t in probe["threads"] if "otel" in t.lower()], probe["threads"]
    assert "otlp_spans_dropped" not in text


def test_a_down_endpoint_fails_no_request_and_counts_dropped_spans(tiny, traced):
    prefill, decode, tmp = traced
    down = f"http://127.0.0.1:{free_port()}/v1/traces"  # nothing listens there
    url, port, proc = _router(tiny, prefill, decode, tmp, ["--otlp-traces-endpoint", down])
    try:
        prompt = random_prompt(43, 24)
        bodies = [_complete(url, prompt) for _ in range(2)]
        assert bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"]
        wait_until(
            lambda: metric_value(port, "tandem:otlp_spans_dropped_total") > 0,
            60,
            "the router to count the spans it could not export",
        )
    finally:
        _stop(proc)
