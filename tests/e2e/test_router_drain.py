"""The router's graceful shutdown (services/router/drain.py), for real: a `tandem router`
subprocess over a colocated engine with the tiny random-weight Llama gets SIGTERM while
requests are open. Within the grace period open requests finish and new ones get a 503
``shutting_down``; past it, a stream ends with an error event and ``[DONE]`` (it used to be
cut with a bare close, which clients take for a complete answer); the router exits 0."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from ports import free_port
from waiting import wait_until

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

MAX_MODEL_LEN = 1024
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "512",
               "--max-model-len", str(MAX_MODEL_LEN)]
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """``(model folder, engine address)`` of one colocated engine for the module."""
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    port = free_port()
    launcher = Launcher(tmp_path_factory.mktemp("drain-engine"))
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{port}", "--model", tiny,
            *ENGINE_ARGS), lambda: grpc_serving(f"127.0.0.1:{port}"))], 300)
        yield tiny, f"127.0.0.1:{port}"
    finally:
        launcher.close(timeout_s=30)


def _router(engine, tmp_path: Path, grace_s: float) -> tuple[Launcher, Part, str]:
    tiny, address = engine
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = Launcher(tmp_path)
    part = Part("router", tandem_argv(
        "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
        "--model", tiny, "--colocated", address, "--max-model-len", str(MAX_MODEL_LEN),
        "--shutdown-grace-s", str(grace_s)), lambda: http_ok(f"{url}/ready"))
    launcher.launch([part], 300)
    return launcher, part, url


class _Stream:
    """One streamed completion read on a thread: its ``data:`` payloads as they arrive."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.data: list[str] = []
        self.error: BaseException | None = None
        body = {"model": _model(url), "prompt": [11, 12, 13], "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S
                              ) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.data.append(line[6:])
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def started(self) -> bool:
        assert self.error is None, self.error
        return len(self.data) >= 2

    def join(self) -> list[str]:
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "the stream never ended"
        assert self.error is None, self.error
        return self.data


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def test_past_the_grace_period_a_stream_ends_with_an_error_event_and_done(engine,
                                                                           tmp_path) -> None:
    launcher, router, url = _router(engine, tmp_path, grace_s=0)
    try:
        stream = _Stream(url, max_tokens=MAX_MODEL_LEN - 8)
        wait_until(stream.started, TIMEOUT_S, "the stream to start")
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        data = stream.join()
        assert data[-1] == "[DONE]"
        last = json.loads(data[-2])
        assert last["error"]["code"] == "shutting_down", last
        assert all("error" not in json.loads(d) for d in data[:-2])
        assert router.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=10)


def test_within_the_grace_period_open_requests_finish_and_new_ones_get_503(engine,
                                                                            tmp_path) -> None:
    launcher, router, url = _router(engine, tmp_path, grace_s=120)
    try:
        model = _model(url)
        stream = _Stream(url, max_tokens=MAX_MODEL_LEN - 8)
        wait_until(stream.started, TIMEOUT_S, "the stream to start")
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)

        def refused() -> dict | None:
            resp = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT_S, json={
                "model": model, "prompt": [5, 6], "max_tokens": 2})
            return resp.json() if resp.status_code == 503 else None

        err = wait_until(refused, TIMEOUT_S, "new requests to be refused")
        assert err["error"]["code"] == "shutting_down"
        assert httpx.get(f"{url}/ready", timeout=30).status_code == 503
        data = stream.join()
        assert data[-1] == "[DONE]"
        finals = [json.loads(d) for d in data[:-1]]
        assert all("error" not in f for f in finals)
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(f["choices"][0]["text"]) > 0 for f in finals) > 0
        assert router.proc.wait(timeout=60) == 0
    finally:
        launcher.close(timeout_s=10)
