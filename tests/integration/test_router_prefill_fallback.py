"""Prefill fallback: a disaggregated stack that loses its prefill tier keeps serving.

Before it, a router whose prefill instances were all down (killed, restarting, failing
every call) answered 503 until one came back, though its decode instances can prefill a
prompt themselves (conditional disaggregation already sends them short prompts). Now a
decode instance prefills the prompt when no prefill instance is up or every Prefill
attempt failed, and the text is what transformers generates.

Real parts: a `tandem serve --role decode` over the tiny random model (float32), real
`tandem router` subprocesses with static instance lists. The failing prefill instance is
a gRPC server in the test process whose Prefill answers UNAVAILABLE (an engine that is
up but cannot serve: a fault no real engine produces on demand); the absent one is a
free port where nothing listens.
"""

from __future__ import annotations

import random

import grpc
import httpx
import pytest
from ports import free_port
from services_harness import (
    Proc,
    grpc_servicer_in_thread,
    hf_greedy,
    metric_value,
    random_prompt,
    wait_for,
)

from tandem.launch import http_ok
from tandem.v1 import common_pb2, prefill_pb2_grpc

#: Flags of the module's decode service (conftest's fixture reads it).
ENGINE_ARGS = ["--num-kv-blocks", "256", "--max-model-len", "512"]


class _FailingPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """A prefill instance that answers its load polls and fails every Prefill."""

    def __init__(self) -> None:
        self.calls = 0
        self.code = grpc.StatusCode.UNAVAILABLE

    async def Prefill(self, request, context):  # noqa: ANN001, ANN201, N802
        self.calls += 1
        await context.abort(self.code, "the engine is restarting"
                            if self.code == grpc.StatusCode.UNAVAILABLE else "it broke")

    async def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802
        return common_pb2.GetLoadResponse(role="prefill")


@pytest.fixture(scope="module")
def failing_prefill():
    servicer = _FailingPrefill()
    with grpc_servicer_in_thread(prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
                                 servicer) as address:
        yield servicer, address


class _Router:
    def __init__(self, tiny: str, tmp, prefill: str, decode: str, *extra: str) -> None:
        port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = Proc(["router", "--host", "127.0.0.1", "--port", str(port),
                          "--grpc-port", str(self.grpc_port), "--model", tiny,
                          "--prefill", prefill,
                          "--decode", decode, "--max-model-len", "512", *extra],
                         tmp / f"router-{port}.log", ready=lambda: http_ok(f"{self.url}/health"))
        self.proc.wait_ready(120)

    def complete(self, prompt: list[int], max_tokens: int) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", timeout=120, json={
            "model": httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"],
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True})

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy token ids of ``prompt`` through the router's gRPC API."""
        from services_harness import params

        from tandem.v1 import generation_pb2, generation_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as ch:
            msgs = list(generation_pb2_grpc.GenerationServiceStub(ch).Generate(
                generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt),
                    sampling_params=params(max_tokens, ignore_eos=True)), timeout=120))
        return [t for m in msgs for t in m.token_ids]

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(int(self.url.rsplit(":", 1)[1]), name, **labels)


@pytest.fixture
def router(tiny, tmp_path):
    started: list[_Router] = []

    def start(*args: str) -> _Router:
        started.append(_Router(tiny, tmp_path, *args))
        return started[-1]

    yield start
    for r in started:
        r.proc.stop()


def test_every_prefill_attempt_failing_the_decode_instance_prefills(tiny, decode,
                                                                      failing_prefill, router):
    servicer, address = failing_prefill
    prompt = random_prompt(random.Random(31), 40)
    want = hf_greedy(tiny, [prompt], max_new_tokens=8)[0]
    r = router(address, decode.address)
    calls = servicer.calls
    resp = r.complete(prompt, 8)  # nothing benched yet: the prefill instance is tried
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8
    t = resp.json()["timings"]
    assert servicer.calls == calls + 1
    assert t["disagg_decision"] == "local_prefill", t
    assert t["disagg_reason"].startswith("every prefill attempt failed (UNAVAILABLE"), t
    assert t["prefill_instance"] == t["decode_instance"] == decode.address
    # the tokens: the decode instance's own prefill continues as transformers does
    assert r.generate(prompt, 8) == want
    assert r.metric("tandem:router_disagg_decision_total", path="local_prefill") == 2
    assert r.metric("tandem:router_disagg_decision_total", path="remote_prefill") == 0


def test_no_prefill_instance_up_the_decode_instance_prefills(tiny, decode, router):
    absent = f"127.0.0.1:{free_port()}"  # nothing listens there
    r = router(absent, decode.address)
    wait_for(lambda: httpx.get(f"{r.url}/ready", timeout=10).json().get("prefill") == "local",
             60, "the router to see the decode instance up and no prefill instance")
    prompt = random_prompt(random.Random(32), 24)
    resp = r.complete(prompt, 6)
    assert resp.status_code == 200, resp.text
    t = resp.json()["timings"]
    assert (t["disagg_decision"], t["disagg_reason"]) == ("local_prefill",
                                                          "no prefill instance is up"), t


def test_with_the_fallback_off_a_failing_prefill_tier_is_a_503(decode, failing_prefill,
                                                               router):
    servicer, address = failing_prefill
    r = router(address, decode.address, "--no-disagg-prefill-fallback")
    resp = r.complete([5, 6, 7, 8], 4)
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"].startswith(
        "no prefill instance could serve the request: UNAVAILABLE"), resp.text



def test_a_request_that_broke_the_prefill_engine_is_not_replayed_on_decode(
        decode, failing_prefill, router):
    """INTERNAL (the engine failed on this request) is no reason to try the same request
    on the decode instances: it is a 503, as without the fallback."""
    servicer, address = failing_prefill
    r = router(address, decode.address)
    servicer.code = grpc.StatusCode.INTERNAL
    try:
        resp = r.complete([5, 6, 7, 8], 4)
    finally:
        servicer.code = grpc.StatusCode.UNAVAILABLE
    assert resp.status_code == 503, resp.text
    assert "INTERNAL it broke" in resp.json()["error"]["message"], resp.text
    assert r.metric("tandem:router_disagg_decision_total", path="local_prefill") == 0
    # a request that ended at its prefill still took the remote prefill path
    assert r.metric("tandem:router_disagg_decision_total", path="remote_prefill") == 1
