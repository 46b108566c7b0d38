"""A client that goes away before its first token cancels the request on the engine.

Bug (H9): a streamed request waited for its first token without watching the client, so a
client that gave up during a long prefill (minutes for a long prompt on a loaded CPU)
left the prefill running to the end, work for nobody. The prefill instance here is a
gRPC server in the test process whose Prefill never answers (the slow prefill) and
records the cancellation; the router is a real `tandem router` subprocess.

Bug: a client that left during a non-streaming request made the router log
``ERROR: Exception in ASGI application`` with a CancelledError traceback; a client going
away is no error, so the router logs it at debug level.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import pytest
from ports import free_port

from tandem.launch import Part, http_ok, start_part, stop_parts, tandem_argv, wait_ready
from tandem.v1 import common_pb2, prefill_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import grpc_servicer_in_thread, tiny_model_dir, wait_for  # noqa: E402


class _SlowPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Prefill that never finishes; counts calls and cancellations (thread-safe reads)."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0

    async def Prefill(self, request, context):  # noqa: ANN001, ANN201, N802
        self.started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802
        return common_pb2.GetLoadResponse(role="prefill")


@pytest.fixture(scope="module")
def slow_prefill():
    servicer = _SlowPrefill()
    with grpc_servicer_in_thread(prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer) as address:
        yield servicer, address


@pytest.fixture(scope="module")
def router(tmp_path_factory, slow_prefill):
    model = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    part = Part("router", tandem_argv(
        "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
        "--model", model, "--prefill", slow_prefill[1], "--decode", f"127.0.0.1:{free_port()}",
        "--max-model-len", "512", "--log-level", "debug"),
        lambda: http_ok(f"{url}/health", timeout_s=1))
    log = tmp_path_factory.mktemp("router") / "router.log"
    start_part(part, log_path=log)
    try:
        wait_ready([part], 120)
        yield url, log
    finally:
        stop_parts([part], timeout_s=20)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_first_token_cancels_prefill(router, slow_prefill, stream) -> None:
    servicer, _ = slow_prefill
    url, log = router
    started, cancelled = servicer.started, servicer.cancelled
    rid = f"gone-{'stream' if stream else 'whole'}"
    body = json.dumps({"prompt": "Hello there", "max_tokens": 4, "stream": stream}).encode()
    host, port = url.removeprefix("http://").split(":")
    # A raw socket: an HTTP client would block waiting for response headers, which a
    # streamed response sends only with the first token.
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"X-Request-Id: {rid}\r\n".encode()
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: servicer.started > started, 60, "the request to reach prefill")
    # The client is gone: the router must cancel the prefill RPC.
    wait_for(lambda: servicer.cancelled > cancelled, 30, "the prefill RPC to be cancelled")
    # The router's own account of it: one debug line, no error and no traceback.
    wait_for(lambda: f"request {rid}: the client disconnected" in log.read_text(), 30,
             "the router to log the disconnect")
    text = log.read_text()
    assert "Exception in ASGI application" not in text, text[-3000:]
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]


def test_disconnect_while_sending_the_body_is_no_error(router) -> None:
    """A client that leaves halfway through its upload: nothing to answer, a debug line
    (Starlette's ClientDisconnect reached the catch-all handler: a 500 and a traceback)."""
    url, log = router
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"prompt": "Hello')
    wait_for(lambda: "the client disconnected while sending the body" in log.read_text(), 30,
             "the router to log the disconnect")
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
