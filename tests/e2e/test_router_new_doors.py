"""The Responses API (``/v1/responses``) and the Anthropic Messages API (``/v1/messages``)
through the official ``openai`` and ``anthropic`` clients.

One colocated engine with the tiny random-weight Llama (float32) behind two `tandem
router` subprocesses that share one Redis for stored responses (the second one with an API
key, which the ``anthropic`` client sends as ``x-api-key``). Greedy answers are the same
on every run, so each door's text is compared with chat completions' for the same
conversation; forced tool calls (a grammar decides their shape) make the tool round trips
independent of the random weights.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Literal

import anthropic
import openai
import pytest
from ports import free_port
from pydantic import BaseModel

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "h5_tiny_llama"
MAX_MODEL_LEN = 640
KEY = "sekret"
SYSTEM = "You answer briefly."
ASK = "Is the sky blue?"
PICK_SCHEMA = {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"], "additionalProperties": False}


# NOTE: compact JSON (vLLM's structured_outputs extension): with free whitespace a random
# model may pad an answer past any small token limit.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
# NOTE: the anthropic client's create() no longer names the sampling fields; the API (and
# tandem) still takes them.
GREEDY = {"temperature": 0}


class Answer(BaseModel):
    answer: Literal["yes", "no"]


@pytest.fixture(scope="module")
def routers(tmp_path_factory, redis_url):
    """(openai client of router A, openai client of router B (API key), anthropic client
    of router B)."""
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    launcher = Launcher(tmp_path_factory.mktemp("doors"))
    eng_port = free_port()
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len",
            str(MAX_MODEL_LEN)), lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        urls, parts = [], []
        for extra in ([], ["--api-key", KEY]):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            parts.append(Part(f"router{len(parts)}", tandem_argv(
                "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
                "--model", tiny, "--colocated", f"127.0.0.1:{eng_port}",
                "--response-store-url", redis_url, *extra),
                lambda url=url: http_ok(f"{url}/ready")))
            urls.append(url)
        launcher.launch(parts, 300)
        yield (openai.OpenAI(base_url=f"{urls[0]}/v1", api_key="none", max_retries=0,
                             timeout=120),
               openai.OpenAI(base_url=f"{urls[1]}/v1", api_key=KEY, max_retries=0,
                             timeout=120),
               anthropic.Anthropic(base_url=urls[1], api_key=KEY, max_retries=0,
                                   timeout=120))
        for part in parts:
            assert part.proc is not None
            part.proc.send_signal(signal.SIGTERM)
            assert part.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=30)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                         temperature=0)
    return out.choices[0].message.content or ""


# -- Responses ---------------------------------------------------------------------------------


def test_responses_text_equals_chat_streamed_or_not(routers) -> None:
    a, _, _ = routers
    want = chat_text(a, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    kw = dict(model=MODEL, instructions=SYSTEM, input=ASK, max_output_tokens=8, temperature=0)
    resp = a.responses.create(**kw)
    assert want and resp.output_text == want
    assert resp.usage.output_tokens == 8 and resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    events = list(a.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text


def test_responses_function_call_round_trip(routers) -> None:
    a, _, _ = routers
    tools = [{"type": "function", "name": "pick", "description": "pick a unit",
              "parameters": PICK_SCHEMA, "strict": True}]
    kw = dict(model=MODEL, input=ASK, tools=tools, temperature=0, max_output_tokens=64,
              tool_choice={"type": "function", "name": "pick"}, extra_body=COMPACT)
    resp = a.responses.create(**kw)
    [call] = [it for it in resp.output if it.type == "function_call"]
    assert call.name == "pick" and json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    with a.responses.stream(**kw) as s:
        deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    [streamed] = [it for it in final.output if it.type == "function_call"]
    assert "".join(deltas) == streamed.arguments == call.arguments
    follow = [{"role": "user", "content": ASK},
              {"type": "function_call", "call_id": call.call_id, "name": "pick",
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}]
    answer = a.responses.create(model=MODEL, input=follow, max_output_tokens=8, temperature=0)
    want = chat_text(a, [{"role": "user", "content": ASK},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": "pick", "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "22 C"}])
    assert answer.output_text == want


def test_responses_text_format_json_schema(routers) -> None:
    a, _, _ = routers
    with a.responses.stream(model=MODEL, input=ASK, text_format=Answer, temperature=0,
                            max_output_tokens=64, extra_body=COMPACT) as s:
        final = s.get_final_response()
    assert final.status == "completed"
    assert isinstance(final.output_parsed, Answer)
    parsed = a.responses.parse(model=MODEL, input=ASK, text_format=Answer, temperature=0,
                               max_output_tokens=64, extra_body=COMPACT)
    assert parsed.output_parsed == final.output_parsed


def test_previous_response_id_across_replicas(routers) -> None:
    a, b, _ = routers
    first = a.responses.create(model=MODEL, input=ASK, max_output_tokens=6, temperature=0)
    second = b.responses.create(model=MODEL, previous_response_id=first.id, input="Why?",
                                max_output_tokens=6, temperature=0)
    want = chat_text(b, [{"role": "user", "content": ASK},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "Why?"}], max_tokens=6)
    assert second.output_text == want and second.previous_response_id == first.id
    assert b.responses.retrieve(first.id).output_text == first.output_text
    unstored = a.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as err:
        b.responses.create(model=MODEL, previous_response_id=unstored.id, input="Why?")
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
])
def test_responses_refuses_what_it_does_not_serve(routers, body, param) -> None:
    a, _, _ = routers
    with pytest.raises(openai.BadRequestError) as err:
        a.responses.create(**{"model": MODEL, "input": ASK, **body})
    assert err.value.body["param"] == param


# -- Messages ----------------------------------------------------------------------------------


def test_messages_text_equals_chat_streamed_or_not(routers) -> None:
    a, _, c = routers
    want = chat_text(a, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    kw = dict(model=MODEL, system=SYSTEM, max_tokens=8, extra_body=GREEDY,
              messages=[{"role": "user", "content": ASK}])
    msg = c.messages.create(**kw)
    assert msg.content[0].text == want and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 8
    with c.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want == final.content[0].text and final.stop_reason == "max_tokens"
    count = c.messages.count_tokens(model=MODEL, system=SYSTEM,
                                    messages=[{"role": "user", "content": ASK}])
    assert count.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    chat = a.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    assert count.input_tokens == chat.usage.prompt_tokens


def test_messages_tool_use_round_trip(routers) -> None:
    _, b, c = routers
    tools = [{"name": "pick", "description": "pick a unit", "input_schema": PICK_SCHEMA}]
    kw = dict(model=MODEL, max_tokens=64, tools=tools,
              tool_choice={"type": "tool", "name": "pick"}, extra_body={**GREEDY, **COMPACT},
              messages=[{"role": "user", "content": ASK}])
    msg = c.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "pick" and use.input["unit"] in ("celsius", "fahrenheit")
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [use.input]
    follow = [{"role": "user", "content": ASK},
              {"role": "assistant", "content": [u.model_dump() for u in msg.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": "22 C"}]}]
    answer = c.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=follow)
    want = chat_text(b, [{"role": "user", "content": ASK},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": use.id, "type": "function", "function": {
                                 "name": "pick", "arguments": json.dumps(use.input)}}]},
                         {"role": "tool", "tool_call_id": use.id, "content": "22 C"}])
    assert answer.content[0].text == want


def test_messages_errors_are_anthropics(routers) -> None:
    _, _, c = routers
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        c.post("/v1/messages", cast_to=object, body={
            "model": MODEL, "messages": [{"role": "user", "content": ASK}]})
    assert "max_tokens" in err.value.body["error"]["message"]
    wrong = c.with_options(api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user",
                                                                    "content": ASK}])
    assert err.value.body["error"]["type"] == "authentication_error"
