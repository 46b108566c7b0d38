"""The router validates against what its engines serve, and says what runs the model.

Two colocated engines over the tiny random-weight Llama (its config: 1024 positions), one
started with ``--max-model-len 256`` (tandem's native implementation), one with
``--max-model-len 384 --model-impl transformers``, both registered in Redis, behind a real
`tandem router` started *without* ``--max-model-len``.

Bug: the router read the context length from the model's config (1024) at start-up, so it
accepted a 300-token prompt that the 256-token engine then failed, and it had no way to
say which architecture and implementation serve the model.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv
from tandem.v1 import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "h5_tiny_llama"
ARCH = "LlamaForCausalLM"
#: (--max-model-len, --model-impl) of each engine
ENGINES = [(256, "tandem"), (384, "transformers")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    """``(router url, router grpc address, engine addresses)``."""
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    tmp = tmp_path_factory.mktemp("facts")
    engines = [f"127.0.0.1:{free_port()}" for _ in ENGINES]
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = Launcher(tmp)
    try:
        launcher.launch([Part(f"engine{i}", tandem_argv(
            "serve", "--role", "both", "--listen", address, "--model", tiny,
            "--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", str(max_len),
            "--model-impl", impl, "--redis-url", redis_url),
            lambda a=address: grpc_serving(a))
            for i, (address, (max_len, impl)) in enumerate(zip(engines, ENGINES, strict=True))],
            300)
        router = Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port",
            str(grpc_port), "--model", tiny, "--colocated", ",".join(engines)),
            lambda: http_ok(f"{url}/ready"))
        launcher.launch([router], 300)
        # /ready holds once one engine answered a poll: wait for both reports
        wait_for(lambda: httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
                 ["model_impl"] == "tandem,transformers", 30, "both engines' reports")
        yield url, f"127.0.0.1:{grpc_port}", engines
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=30)


def test_get_load_and_the_registry_carry_the_model_facts(stack, redis_url) -> None:
    _, _, engines = stack
    for address, (max_len, impl) in zip(engines, ENGINES, strict=True):
        with grpc.insecure_channel(address) as ch:
            load = decode_pb2_grpc.DecodeServiceStub(ch).GetLoad(common_pb2.GetLoadRequest(),
                                                                   timeout=30)
        assert (load.max_model_len_tokens, load.vocab_size_tokens, load.architecture,
                load.model_impl) == (max_len, 49152, ARCH, impl)
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        entries = [r.hgetall(k) for k in r.scan_iter("tandem:instance:both:*")]
    finally:
        r.close()
    ours = {e["address"]: e for e in entries if e.get("address") in engines}
    assert sorted(ours) == sorted(engines)
    for address, (max_len, impl) in zip(engines, ENGINES, strict=True):
        e = ours[address]
        assert (e["max_model_len_tokens"], e["vocab_size_tokens"], e["architecture"],
                e["model_impl"]) == (str(max_len), "49152", ARCH, impl)


def test_models_report_the_engines_context_architecture_and_implementation(stack) -> None:
    url = stack[0]
    listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    one = httpx.get(f"{url}/v1/models/{MODEL}", timeout=30).json()
    for card in (*listed, one):
        assert (card["max_model_len"], card["architecture"], card["model_impl"]) == (
            256, ARCH, "tandem,transformers"), card


def test_a_prompt_over_the_smallest_engine_limit_is_a_400_naming_it(stack) -> None:
    url = stack[0]
    for body, param in (({"prompt": [5] * 300}, "messages"),
                        ({"prompt": [5] * 200, "max_tokens": 100}, "max_tokens")):
        resp = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"model": MODEL, "max_tokens": 2, **body})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert "maximum context length is 256 tokens" in err["message"]
    resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": [5] * 200, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


def test_the_public_grpc_api_checks_the_same_limit(stack) -> None:
    with grpc.insecure_channel(stack[1]) as ch, pytest.raises(grpc.RpcError) as info:
        list(generation_pb2_grpc.GenerationServiceStub(ch).Generate(
            generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5] * 300)),
            timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "256" in info.value.details()
