"""The router's error surface: every invalid input gets the right OpenAI 4xx JSON.

A real `tandem router` subprocess (the tiny test model's tokenizer, no weights) in front of
static instance addresses where nothing listens: every check here happens before any
engine is called, and a valid request then fails with 503 + Retry-After (no instance),
never with a 500. The same checks through the public gRPC API map to gRPC codes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from ports import free_port

from tandem.launch import Part, http_ok, start_part, stop_parts, tandem_argv, wait_ready
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

API_KEY = "sk-test-key"
MODEL = "h5_tiny_llama"  # the tiny model folder's name, which the router serves
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    model = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    port, grpc_port = free_port(), free_port()
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    log = tmp_path_factory.mktemp("router") / "router.log"
    env = dict(os.environ, TANDEM_API_KEY=API_KEY)
    url = f"http://127.0.0.1:{port}"
    part = Part("router", tandem_argv(
        "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--model", model, "--prefill", dead[0], "--decode", dead[1],
        "--max-model-len", str(MAX_MODEL_LEN)), lambda: http_ok(f"{url}/health", timeout_s=1))
    proc = start_part(part, log_path=log, env=env)
    try:
        wait_ready([part], 120)
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=20) == 0, "router did not exit cleanly on SIGTERM"
        finally:
            stop_parts([part], timeout_s=0)


@pytest.fixture(scope="module")
def http(router):
    with httpx.Client(base_url=router[0], timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
COMPLETION = {"model": MODEL, "prompt": "Hello"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_k": 0}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, "n"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -5}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "min_p": 2}, "min_p"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 99999999]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [[1, 2], [-3]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {**COMPLETION, "suffix": "x"}, "suffix"),
    ("/v1/completions", {**COMPLETION, "best_of": 3}, "best_of"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
])
def test_invalid_parameter_is_400_naming_the_field(http, path, body, param) -> None:
    err = _error(http.post(path, json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def _call(args: object, call_id: str = "c1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": args}}


def _tool(params: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": params}}


_USER = {"role": "user", "content": "Hello"}
_NOT = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
_SO_CASES = [
    # Each was accepted before (a 503 here, a 200 with a running stack) or named the wrong
    # field; the message must name the client's field and say why.
    ({"messages": [_USER, {"role": "assistant", "tool_calls": [_call('{"x": 1}')]},
                   {"role": "tool", "tool_call_id": "c2", "content": "3"}]},
     "messages[2].tool_call_id", "answers no tool call"),
    ({"messages": [_USER, {"role": "assistant", "tool_calls": [_call({"x": 1})]}]},
     "messages[1].tool_calls[0].function.arguments", "string holding a JSON object"),
    ({"messages": [_USER, {"role": "assistant", "tool_calls": [_call("{x")]}]},
     "messages[1].tool_calls[0].function.arguments", "string holding a JSON object"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [_call("{}")]}]},
     "messages[0].tool_calls", "only assistant"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens",
     "cannot be combined"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}, "stream": True},
     "min_tokens", "cannot be combined"),
    ({"guided_json": '{"type": []}'}, "guided_json", "not a valid JSON schema at #/type"),
    ({"guided_json": "true"}, "guided_json", "must be a JSON schema object"),
    ({"structured_outputs": {"json": True}}, "structured_outputs.json",
     "must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"tools": [_tool(_NOT)], "tool_choice": "required"}, "tools[0].function.parameters",
     "'not' at #/properties/a"),
    ({"tools": [_tool({"type": "object"}), {"type": "function", "function": {
        "name": "g", "parameters": _NOT}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tools[1].function.parameters", "'not' at #/properties/a"),
]


@pytest.mark.parametrize(("extra", "param", "match"), _SO_CASES)
def test_constraint_and_tool_turn_errors_name_the_clients_field(http, extra, param,
                                                                match) -> None:
    err = _error(http.post("/v1/chat/completions", json={**CHAT, **extra}), 400)
    assert err["param"] == param, err
    assert match in err["message"], err
    assert "structured_outputs" not in err["message"] or param.startswith("structured_outputs")


@pytest.mark.parametrize("field", ["messages", "tools", "tool_choice", "parallel_tool_calls",
                                   "max_completion_tokens"])
def test_chat_fields_on_completions_are_400s(http, field) -> None:
    value = {"messages": CHAT["messages"], "tools": [_tool({"type": "object"})],
             "tool_choice": "required", "parallel_tool_calls": False,
             "max_completion_tokens": 3}[field]
    err = _error(http.post("/v1/completions", json={**COMPLETION, field: value}), 400)
    assert err["param"] == field and "Chat Completions field" in err["message"], err


def test_a_schema_keyword_only_matters_where_it_is_enforced(http) -> None:
    # tool_choice auto renders the tools and constrains nothing: 'not' is fine there (a
    # 503 here: no instance listens).
    _error(http.post("/v1/chat/completions", json={**CHAT, "tools": [_tool(_NOT)]}), 503)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "seed": 10**30}, "seed"),
    ("/v1/chat/completions", {**CHAT, "top_k": 2**40}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "priority": 2**40}, "priority"),
    ("/v1/completions", {**COMPLETION, "seed": -(2**70)}, "seed"),
    ("/v1/chat/completions", {**CHAT, "temperature": float("nan")}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": float("nan")}, "repetition_penalty"),
])
def test_out_of_range_numbers_are_400_not_500(http, path, body, param) -> None:
    """Bug (H9): integers beyond the protobuf field widths (seed int64, top_k / priority
    int32) passed validation and crashed the router when building the RPC (500, and the
    keep-alive connection was dropped); NaN temperature / repetition_penalty (Python's
    json accepts ``NaN``) were accepted and sampled garbage."""
    # json.dumps writes NaN as Python's json (and so the router) reads it; httpx would not.
    resp = http.post(path, content=json.dumps(body),
                     headers={"Content-Type": "application/json"})
    err = _error(resp, 400)
    assert err["param"] == param, err


def test_context_length_exceeded(http) -> None:
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": MAX_MODEL_LEN}),
                 400)
    assert err["code"] == "context_length_exceeded"
    long_prompt = " ".join(["word"] * (MAX_MODEL_LEN + 10))
    err = _error(http.post("/v1/completions", json={**COMPLETION, "prompt": long_prompt}), 400)
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body_is_400(http, content: bytes) -> None:
    resp = http.post("/v1/chat/completions", content=content,
                     headers={"Content-Type": "application/json"})
    _error(resp, 400)


def test_unknown_model_is_404(http) -> None:
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-17"}), 404)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"


def test_api_key_required(router) -> None:
    url = router[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        err = _error(httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers), 401)
        assert err["type"] == "authentication_error"
    _error(httpx.get(f"{url}/v1/models"), 401)
    # Health and metrics stay open (probes and scrapers carry no key).
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_models_lists_served_name(router) -> None:
    client = openai.OpenAI(base_url=f"{router[0]}/v1", api_key=API_KEY, max_retries=0)
    ids = [m.id for m in client.models.list().data]
    assert MODEL in ids


def test_no_instance_is_503_with_retry_after_and_request_id_echoed(http) -> None:
    # Unknown fields are ignored (warning in the log), so this is a valid request.
    body = {**CHAT, "max_tokens": 4, "some_future_field": {"x": 1}}
    resp = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "req-503"})
    err = _error(resp, 503)
    assert resp.headers["Retry-After"] == "1"
    assert resp.headers["X-Request-Id"] == "req-503"
    assert err["type"] == "service_unavailable_error"
    resp = http.post("/v1/completions", json={**COMPLETION, "stream": True})
    _error(resp, 503)  # nothing streamed yet: a plain HTTP error
    assert http.get("/ready").status_code == 503


def test_models_retrieve(router) -> None:
    """Bug: ``GET /v1/models/{id}`` (the openai client's ``models.retrieve``) was a bare
    404 for every id."""
    client = openai.OpenAI(base_url=f"{router[0]}/v1", api_key=API_KEY, max_retries=0)
    names = [m.id for m in client.models.list().data]
    assert any("/" in name for name in names), names  # the model folder's path
    for name in names:
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "tandem")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-17")
    err = info.value.body
    assert isinstance(err, dict) and (err["code"], err["param"]) == ("model_not_found", "model")
    assert "gpt-17" in err["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router[0]}/v1", api_key="wrong",
                      max_retries=0).models.retrieve(MODEL)


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/audio/speech"), ("POST", "/v1/embeddings"), ("GET", "/v1/nothing-here"),
    ("GET", "/"), ("GET", "/v1/files")])
def test_an_unknown_route_is_a_404_naming_it(http, method, path) -> None:
    """Bug: a bare ``404 Not Found`` that named neither the route nor that tandem does not
    serve it."""
    err = _error(http.request(method, path, json={}), 404)
    assert err["type"] == "not_found_error"
    message = err["message"]
    assert f"({method} {path})" in message and "tandem does not serve" in message, message
    assert "POST /v1/chat/completions" in message and "GET /v1/models/{model}" in message


def test_a_known_route_with_another_method_is_a_405_naming_it(http) -> None:
    resp = http.get("/v1/chat/completions")
    err = _error(resp, 405)
    assert "GET /v1/chat/completions" in err["message"]
    assert resp.headers["Allow"] == "POST"


def test_the_openai_client_sees_which_api_tandem_lacks(router) -> None:
    client = openai.OpenAI(base_url=f"{router[0]}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match=r"POST /v1/moderations"):
        client.moderations.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError, match=r"POST /v1/embeddings"):
        client.embeddings.create(model=MODEL, input="hi")


def test_openai_client_sees_bad_request(router) -> None:
    client = openai.OpenAI(base_url=f"{router[0]}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-2)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_grpc_errors(router) -> None:
    md = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(router[1]) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)

        def code(req: generation_pb2.GenerateRequest, metadata=md) -> grpc.StatusCode:  # noqa: ANN001
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(req, metadata=metadata, timeout=30))
            return info.value.code()

        sp = common_pb2.SamplingParams
        assert code(generation_pb2.GenerateRequest(text="hi"), ()) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert code(generation_pb2.GenerateRequest(
            text="hi", sampling_params=sp(temperature=-1))) == grpc.StatusCode.INVALID_ARGUMENT
        assert code(generation_pb2.GenerateRequest()) == grpc.StatusCode.INVALID_ARGUMENT
        assert code(generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=[10**8]))) == grpc.StatusCode.INVALID_ARGUMENT
        assert code(generation_pb2.GenerateRequest(
            text="hi", model="gpt-17")) == grpc.StatusCode.NOT_FOUND
        assert code(generation_pb2.GenerateRequest(
            text="hi", sampling_params=sp(max_tokens=4))) == grpc.StatusCode.UNAVAILABLE
        chat = generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role="wizard", content="hi")])
        assert code(generation_pb2.GenerateRequest(chat=chat)) == \
            grpc.StatusCode.INVALID_ARGUMENT
        # Bytes protobuf refuses (field 3, ``text``, holding bytes that are not UTF-8):
        # INVALID_ARGUMENT, not grpc's UNKNOWN for a deserializer that raised.
        raw = ch.unary_stream("/tandem.v1.GenerationService/Generate",
                              request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            list(raw(bytes([0x1A, 2, 0xFF, 0xFE]), metadata=md, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
