"""What the official ``openai`` client's helpers see from the router: structured outputs in
the schema's own key order, stream events in OpenAI's shape, a tool-call list cut short.

A colocated engine with the tiny random-weight Llama (float32) behind a `tandem router`
subprocess, driven by the ``openai`` SDK (``chat.completions.parse`` and ``.stream``, the
helpers LangChain, instructor and the Agents SDK build on). Random weights suffice: the
grammar decides the shape of every answer here, the model only its values, and greedy
answers are the same on every run.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Literal

import openai
import pytest
from ports import free_port
from pydantic import BaseModel, Field

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "h5_tiny_llama"  # the tiny model folder's name, which the router serves
MAX_MODEL_LEN = 640
ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256",
               "--max-model-len", str(MAX_MODEL_LEN)]
# NOTE: compact JSON: with free whitespace a random model may pad an answer past any
# small max_tokens.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
ASK = [{"role": "user", "content": "Is the sky blue?"}]
# NOTE: the tiny model's greedy answer to this with TOOLS is several calls.
WEATHER = [{"role": "user", "content": "What is the weather?"}]


class Verdict(BaseModel):
    """Reason, then answer: the fields are not in alphabetical order."""

    reasoning: str = Field(max_length=12)
    answer: Literal["yes", "no"]


class Pick(BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    ok: bool


class Count(BaseModel):
    a: int = Field(ge=0, le=9)


VERDICT_TOOL = openai.pydantic_function_tool(Verdict, name="give_verdict")
TOOLS = [openai.pydantic_function_tool(Pick, name="pick"),
         openai.pydantic_function_tool(Count, name="count")]
NAMED = {"type": "function", "function": {"name": "pick"}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    tmp = tmp_path_factory.mktemp("clients")
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
            "--max-model-len", str(MAX_MODEL_LEN)), lambda: http_ok(f"{url}/ready"))
        launcher.launch([router], 300)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=30)


# -- the schema's key order --------------------------------------------------------------------


def test_parse_answers_in_the_schemas_field_order(client) -> None:
    """Bug: the schema was compiled with sorted keys, so `reasoning` then `answer` came out
    as `answer` then `reasoning`, which defeats reason-then-answer prompting."""
    kw = dict(model=MODEL, messages=ASK, response_format=Verdict, max_tokens=64,
              temperature=0, extra_body=COMPACT)
    message = client.chat.completions.parse(**kw).choices[0].message
    assert list(json.loads(message.content)) == ["reasoning", "answer"]
    assert isinstance(message.parsed, Verdict)
    with client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert list(json.loads(streamed.content)) == ["reasoning", "answer"]
    assert streamed.parsed == message.parsed


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "give_verdict"}}])
def test_strict_tool_arguments_come_in_the_schemas_field_order(client, tool_choice) -> None:
    choice = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[VERDICT_TOOL], tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=96, temperature=0, extra_body=COMPACT).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "give_verdict"
    assert list(json.loads(call.function.arguments)) == ["reasoning", "answer"]
    assert isinstance(call.function.parsed_arguments, Verdict)


# -- stream chunks -----------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_the_stream_helper_fires_a_done_event_for_every_call(client, tool_choice) -> None:
    """Bug: a `required` call came in the same chunk as finish_reason "tool_calls", and the
    SDK fires `tool_calls.function.arguments.done` for a choice's last call only on a later
    chunk: the event never came."""
    with client.chat.completions.stream(
            model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=160, temperature=0, extra_body=COMPACT) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    done = [(e.index, e.name, e.arguments) for e in events
            if e.type == "tool_calls.function.arguments.done"]
    calls = final.message.tool_calls
    assert done == [(i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]


@pytest.mark.parametrize("kw", [
    {},
    {"tools": TOOLS, "tool_choice": "none"},
    {"tools": TOOLS, "tool_choice": "auto"},
    {"tools": TOOLS, "tool_choice": "required", "extra_body": COMPACT},
    {"tools": TOOLS, "tool_choice": NAMED, "extra_body": COMPACT},
    {"response_format": {"type": "json_object"}, "extra_body": COMPACT},
], ids=["plain", "none", "auto", "required", "named", "json"])
@pytest.mark.parametrize("max_tokens", [4, 160])
def test_the_finish_reason_comes_in_a_chunk_of_its_own(client, kw, max_tokens) -> None:
    """As OpenAI's streams end: the last chunk of a choice has an empty delta and the
    finish reason; no chunk before it has one."""
    chunks = [c for c in client.chat.completions.create(
        model=MODEL, messages=WEATHER, max_tokens=max_tokens, temperature=0, stream=True, **kw)
        if c.choices]
    *body, last = chunks
    assert last.choices[0].finish_reason is not None
    assert last.choices[0].delta.model_dump(exclude_none=True) == {}
    assert all(c.choices[0].finish_reason is None for c in body)
    assert body and body[0].choices[0].delta.role == "assistant"


# -- a call list cut short ---------------------------------------------------------------------


def _first_item_end(text: str) -> int:
    """Where the first object of the JSON array ``text`` ends (its arguments hold no
    strings with braces: enums, booleans, integers)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "}" and depth == 0:
            return i + 1
    raise AssertionError(f"no complete item in {text!r}")


def _streamed_calls(client, **kw) -> tuple[list[tuple[str, str]], str, str | None]:
    """(name, arguments) of each call, the content and the finish reason of a stream."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(n, a) for n, a in calls.values()], content, finish


def test_a_required_list_cut_by_max_tokens_keeps_its_complete_calls(client) -> None:
    """Bug: the cut answer had `tool_calls: null` and the partial JSON as content, dropping
    the calls it had completed."""
    kw = dict(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required",
              temperature=0, extra_body=COMPACT)
    whole = client.chat.completions.create(max_tokens=160, logprobs=True, **kw).choices[0]
    tokens = [t.token for t in whole.logprobs.content]
    text = "".join(tokens)  # the list, then the EOS token's text
    assert len(json.JSONDecoder().raw_decode(text)[0]) == len(whole.message.tool_calls), text
    end = _first_item_end(text)
    cut = next(k for k in range(1, len(tokens)) if len("".join(tokens[:k])) >= end)
    assert "]" not in "".join(tokens[:cut])[end:], "the cut leaves the list open"
    first = whole.message.tool_calls[0]
    want = [(first.function.name, first.function.arguments)]

    choice = client.chat.completions.create(max_tokens=cut, **kw).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == want
    assert _streamed_calls(client, max_tokens=cut, **kw) == (want, "", "length")
    # Cut inside the first call: nothing is complete, and no half call is content.
    choice = client.chat.completions.create(max_tokens=cut - 1, **kw).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == \
        ("length", None, None)
