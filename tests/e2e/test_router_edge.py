"""The router's hardened HTTP edge, against a real router in front of a real engine.

A colocated engine with the tiny random-weight Llama (float32) behind a `tandem router`
subprocess with a small ``--max-request-body-bytes``: every malformed body gets its 4xx in
OpenAI's form and the next, normal request on the same connection is answered (200);
``/openapi.json`` documents the request and response models; a bounded schemathesis run
against that document finds no 5xx; the public gRPC port serves reflection and health.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

MODEL = "h5_tiny_llama"  # the tiny model folder's name, which the router serves
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 64 * 1024
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256",
               "--max-model-len", str(MAX_MODEL_LEN)]
REQUEST_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """``(http url, grpc address, router log path)`` of a router over one colocated engine."""
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    tmp = tmp_path_factory.mktemp("edge")
    eng_port, port, grpc_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = Launcher(tmp)
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            *ENGINE_ARGS), lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        router = Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port",
            str(grpc_port), "--model", tiny, "--colocated", f"127.0.0.1:{eng_port}",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-request-body-bytes", str(MAX_BODY_BYTES)),
            lambda: http_ok(f"{url}/ready"))
        launcher.launch([router], 300)
        yield url, f"127.0.0.1:{grpc_port}", tmp / "router.log"
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=30)


@pytest.fixture
def http(edge):
    with httpx.Client(base_url=edge[0], timeout=REQUEST_TIMEOUT_S) as client:
        yield client


GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


def _post_raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST ``text`` as is (lone surrogates as JSON escapes, which httpx would not write)."""
    return http.post(path, content=text.encode(), headers={"content-type": "application/json"})


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    return err


def _good_request_succeeds(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json=GOOD)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


#: Stand for lone surrogates in the bodies below; ``_raw`` writes them as JSON escapes
#: (which ``json.dumps`` and httpx would never write).
HI, LO = "<HI>", "<LO>"
_MSG = [{"role": "user", "content": "x"}]


def _raw(body: dict) -> str:
    return json.dumps(body).replace(HI, "\\ud800").replace(LO, "\\udfff")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**GOOD, "prompt": f"a{HI}b"}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["ok", LO]}, "prompt[1]"),
    ("/v1/completions", {**GOOD, "stop": [HI]}, "stop[0]"),
    ("/v1/completions", {**GOOD, "model": f"m{HI}"}, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": f"hi {HI}"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": HI}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {**CHAT, "messages": _MSG, "tools": [
        {"type": "function", "function": {"name": "f", "description": HI}}]},
     "tools[0].function.description"),
    ("/v1/chat/completions", {**CHAT, "messages": _MSG, "user": LO + HI}, "user"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "x", f"k{HI}": 1}]}, "messages[0]"),
])
def test_lone_surrogate_is_400_naming_the_field(http, path, body, param) -> None:
    """Bug: a lone UTF-16 surrogate (valid JSON, invalid Unicode) in ``prompt``, a message's
    content or ``model`` was a 500 (TypeError / UnicodeEncodeError in the tokenizer or a
    log call)."""
    err = _error(_post_raw(http, path, _raw(body)), 400)
    assert err["param"] == param, err
    assert "surrogate" in err["message"], err
    _good_request_succeeds(http)


def test_a_surrogate_pair_is_valid_text(http) -> None:
    """The escape pair of one astral character is valid Unicode, not a lone surrogate."""
    resp = _post_raw(http, "/v1/completions", json.dumps({**GOOD, "prompt": "smile \U0001F600"}))
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("content", [
    b'{"model": "h5_tiny_llama", "prompt": "\xff"}',  # not UTF-8
    b'{"model": "h5_tiny_llama", "prompt": "\xed\xa0\x80"}',  # a surrogate encoded in UTF-8
    '{"model": "h5_tiny_llama", "prompt": "x"}'.encode("utf-16"),  # valid JSON, not UTF-8
])
def test_body_that_is_not_utf8_is_400(http, content: bytes) -> None:
    err = _error(http.post("/v1/completions", content=content,
                           headers={"content-type": "application/json"}), 400)
    assert "UTF-8" in err["message"], err
    _good_request_succeeds(http)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**GOOD, "stream": "yes"}, "stream"),
    ("/v1/completions", {**GOOD, "stream": 1}, "stream"),
    ("/v1/completions", {**GOOD, "prompt": [False]}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {**GOOD, "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**GOOD, "temperature": True}, "temperature"),
    ("/v1/completions", {**GOOD, "echo": "false"}, "echo"),
    ("/v1/completions", {**GOOD, "seed": "7"}, "seed"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": "1"}}, "logit_bias.5"),
    ("/v1/completions", {**GOOD, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "n": "1"}, "n"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "x"}, {"role": "User", "content": "y"}]}, "messages[1].role"),
])
def test_strict_types_and_roles_are_400_naming_the_field(http, path, body, param) -> None:
    """Bug: lax parsing -- ``"stream": "yes"`` turned streaming on, ``prompt: [false]``
    was token 0, numbers as strings were taken, roles ``"wizard"`` and ``""`` reached the
    chat template."""
    err = _error(http.post(path, json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    _good_request_succeeds(http)


def test_prompt_of_another_type_names_every_accepted_form(http) -> None:
    err = _error(http.post("/v1/completions", json={**GOOD, "prompt": [False]}), 400)
    assert "list[int]" in err["message"] and "list[list[int]]" in err["message"], err


def test_every_role_is_accepted(http) -> None:
    """``developer`` included: this template never names it, so it renders as ``system``."""
    for role in ("system", "developer", "user"):
        resp = http.post("/v1/chat/completions", json={**CHAT, "messages": [
            {"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        assert resp.status_code == 200, (role, resp.text)
    resp = http.post("/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"}]})
    assert resp.status_code == 200, resp.text


def test_developer_message_renders_as_system(http) -> None:
    """The same conversation with ``developer`` and with ``system`` is the same prompt."""
    counts = []
    for role in ("developer", "system"):
        resp = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "messages": [
            {"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        assert resp.status_code == 200, resp.text
        counts.append((resp.json()["usage"]["prompt_tokens"],
                       resp.json()["choices"][0]["message"]["content"]))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("nested", ["[" * 3000 + "]" * 3000, '{"a": ' * 3000 + "1" + "}" * 3000])
def test_nesting_too_deep_is_400(http, nested: str) -> None:
    text = json.dumps({**GOOD, "x": "<NESTED>"}).replace('"<NESTED>"', nested)
    err = _error(_post_raw(http, "/v1/completions", text), 400)
    assert "nested too deeply" in err["message"]
    _good_request_succeeds(http)


def test_body_over_the_limit_is_413_then_the_connection_serves_on(http) -> None:
    big = {**GOOD, "prompt": "word " * (MAX_BODY_BYTES // 5 + 1)}
    err = _error(http.post("/v1/completions", json=big), 413)
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(MAX_BODY_BYTES) in err["message"]
    _good_request_succeeds(http)


def test_chunked_body_over_the_limit_is_413(http) -> None:
    """Without a Content-Length the limit holds on the bytes received (chunked upload)."""
    text = json.dumps({**GOOD, "prompt": "word " * (MAX_BODY_BYTES // 5 + 1)}).encode()

    def chunks():  # a generator body: httpx sends it chunked, without Content-Length
        for i in range(0, len(text), 4096):
            yield text[i:i + 4096]

    resp = http.post("/v1/completions", content=chunks(),
                     headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in resp.request.headers}
    _error(resp, 413)
    _good_request_succeeds(http)


def test_body_just_under_the_limit_is_read(http) -> None:
    """The limit is on bytes: a body of exactly the limit (an unknown field padding it)
    is served, not a 413."""
    head = json.dumps(GOOD)[:-1]
    filler = MAX_BODY_BYTES - len(head) - len(', "pad": ""}')
    text = head + ', "pad": "' + "x" * filler + '"}'
    assert len(text.encode()) == MAX_BODY_BYTES
    resp = _post_raw(http, "/v1/completions", text)
    assert resp.status_code == 200, resp.text


def test_openapi_documents_requests_responses_and_metrics(http) -> None:
    """Bug: /openapi.json described no request body and no response schema for the
    generation routes (API tooling saw routes that take nothing), and /metrics as JSON."""
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, req, resp in (("/v1/completions", "CompletionRequest", "CompletionResponse"),
                            ("/v1/chat/completions", "ChatCompletionRequest",
                             "ChatCompletionResponse")):
        op = doc["paths"][path]["post"]
        body = op["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"] == \
            f"#/components/schemas/{req}"
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"] == f"#/components/schemas/{resp}"
        assert "text/event-stream" in ok
        for status in ("400", "401", "404", "413", "503"):
            assert op["responses"][status]["content"]["application/json"]["schema"][
                "$ref"] == "#/components/schemas/ErrorResponse"
        assert req in schemas and resp in schemas
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert schemas["CompletionRequest"]["properties"]["stream"]["type"] == "boolean"
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == [
        "system", "developer", "user", "assistant", "tool"]
    details = schemas["UsageInfo"]["properties"]["prompt_tokens_details"]
    assert {"$ref": "#/components/schemas/PromptTokensDetails"} in details["anyOf"]
    assert schemas["PromptTokensDetails"]["properties"]["cached_tokens"]["type"] == "integer"
    # Every reference resolves inside the document.
    refs = {m for m in _refs(doc)}
    assert refs <= {f"#/components/schemas/{n}" for n in schemas}, refs
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def _refs(node: object):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error(edge, mode: str) -> None:
    """A bounded property-based run over every operation of the served /openapi.json, with
    bodies valid by the schema (positive) and invalid ones (negative: wrong types, missing
    fields): no answer is a 5xx and every answer has a documented status, content type and
    shape. Derandomized: the same cases every run."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{edge[0]}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    if mode == "negative":  # only a request body can be made invalid
        operations = [op for op in operations if op.method.upper() == "POST"]
    for op in operations:
        @settings(max_examples=25 if op.method.upper() == "POST" else 3, deadline=None,
                  database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(GenerationMode(mode)))
        def run(case) -> None:  # noqa: ANN001
            case.call_and_validate(base_url=edge[0], checks=checks,
                                   timeout=REQUEST_TIMEOUT_S)

        run()


def test_grpc_reflection_and_health(edge) -> None:
    """Bug: the router's public gRPC port answered reflection with UNIMPLEMENTED, so
    grpcurl-style clients could not discover ``tandem.v1.GenerationService``."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(edge[1]) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"tandem.v1.GenerationService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services, services
        pool = descriptor_pool.DescriptorPool(db)
        svc = pool.FindServiceByName("tandem.v1.GenerationService")
        method = svc.FindMethodByName("Generate")
        assert method.input_type.full_name == "tandem.v1.GenerateRequest"
        assert method.server_streaming
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "tandem.v1.GenerationService"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_grpc_message_over_the_limit_is_resource_exhausted(edge) -> None:
    """--max-request-body-bytes bounds the public gRPC port's messages too."""
    sp = common_pb2.SamplingParams(max_tokens=2, temperature=0)
    with grpc.insecure_channel(edge[1]) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(
                text="x" * (MAX_BODY_BYTES + 1), sampling_params=sp), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        out = list(stub.Generate(generation_pb2.GenerateRequest(text="Hello",
                                                                sampling_params=sp), timeout=60))
        assert out[-1].finish_reason != 0 and sum(len(o.token_ids) for o in out) == 2
