"""The model folder's ``generation_config.json`` sets the sampling values of requests
that leave them unset (vLLM's ``--generation-config auto``), over HTTP and gRPC.

The router is a real ``tandem router`` subprocess; the engine is a DecodeService stub in
the test process (``bench/router_ceiling.py``'s) that records the sampling parameters
it is sent: what the router resolved is what an engine gets.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import grpc
import openai
import pytest
from ports import free_port

from tandem.bench.router_ceiling import StubDecodeServicer
from tandem.launch import Part, http_ok, start_part, stop_parts, tandem_argv, wait_ready
from tandem.v1 import decode_pb2_grpc, generation_pb2, generation_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import grpc_servicer_in_thread, tiny_model_dir  # noqa: E402

GENERATION_CONFIG = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
                     "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 5}


class _Recording(StubDecodeServicer):
    def __init__(self) -> None:
        super().__init__([5, 6, 7], 0.0, "tiny")
        self.seen: list = []

    async def responses(self, request):  # noqa: ANN001, ANN201
        self.seen.append(request.sampling_params)
        async for msg in super().responses(request):
            yield msg


@pytest.fixture(scope="module")
def engine():
    servicer = _Recording()
    with grpc_servicer_in_thread(decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer) as address:
        yield servicer, address


@pytest.fixture(scope="module")
def router(tmp_path_factory, engine):
    model = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_model_dir(tmp_path_factory.getbasetemp()), model)
    (model / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    part = Part("router", tandem_argv(
        "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--model", str(model), "--colocated", engine[1], "--max-model-len", "512"),
        lambda: http_ok(f"{url}/health", timeout_s=1))
    log = tmp_path_factory.mktemp("router") / "router.log"
    start_part(part, log_path=log)
    try:
        wait_ready([part], 120)
        yield url, f"127.0.0.1:{grpc_port}", log
    finally:
        stop_parts([part], timeout_s=20)


def test_unset_fields_take_the_models_values_and_set_ones_win(router, engine) -> None:
    servicer, _ = engine
    url, _, log = router
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    before = len(servicer.seen)
    out = client.completions.create(model="tiny", prompt="Hello there")
    assert out.usage.completion_tokens == 5  # max_new_tokens
    sp = servicer.seen[before]
    assert (round(sp.temperature, 6), round(sp.top_p, 6), sp.top_k, round(sp.min_p, 6),
            round(sp.repetition_penalty, 6)) == (0.6, 0.9, 20, 0.0, 1.05)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                   temperature=0.0, top_p=1.0, max_tokens=2,
                                   extra_body={"top_k": -1, "repetition_penalty": 1.0})
    sp = servicer.seen[before + 1]
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (
        0.0, 1.0, -1, 1.0, 2)
    assert "default sampling values from" in log.read_text()


def test_the_grpc_api_takes_the_same_defaults(router, engine) -> None:
    servicer, _ = engine
    _, address, _ = router
    before = len(servicer.seen)

    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            req = generation_pb2.GenerateRequest(text="Hello there")
            async for _ in stub.Generate(req):
                pass

    asyncio.run(run())
    sp = servicer.seen[before]
    assert (round(sp.temperature, 6), sp.top_k, sp.max_tokens) == (0.6, 20, 5)
