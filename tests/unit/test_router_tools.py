"""The router's side of structured outputs and tool calling, without a server or a model:
one constraint per request (services/router/structured.py), tools and tool_choice, the
hermes parser fed in every split, the shipped chat template (services/router/tools.py,
frontend.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.engine.model_files import load_tokenizer
from tandem.services.router.config import RouterConfig
from tandem.services.router.errors import OpenAIError
from tandem.services.router.frontend import load_shipped_template, read_chat_template
from tandem.services.router.main import build_parser
from tandem.services.router.protocol import ChatCompletionRequest
from tandem.services.router.structured import build_constraint
from tandem.services.router.tools import (
    ToolCallParser,
    complete_array_items,
    finish_reason_with_calls,
    parse_tool_choice,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
]


def _build(**kw: object):
    return build_constraint(
        response_format=kw.pop("response_format", None),
        structured_outputs=kw.pop("structured_outputs", None),
        legacy=kw,
    )


@pytest.mark.parametrize(
    ("kw", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            "response_format.json_schema.schema",
        ),
        (
            {"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
            "regex",
            "structured_outputs.regex",
        ),
        ({"guided_json": SCHEMA}, "json", "guided_json"),
        ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
    ],
)
def test_each_way_of_asking_builds_one_constraint(kw, kind, param) -> None:
    c = _build(**kw)
    assert c.params is not None and c.params.kind == kind and c.param == param
    assert c.param_of_field == {f"structured_outputs.{kind}": param}


def test_text_format_is_no_constraint() -> None:
    assert _build(response_format={"type": "text"}).params is None
    assert _build().params is None


@pytest.mark.parametrize(
    ("kw", "param", "match"),
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
            "response_format and guided_regex both",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "choice": ["a"]}},
            "structured_outputs.json",
            "structured_outputs.json and structured_outputs.choice both",
        ),
        ({"guided_choice": []}, "guided_choice", "guided_choice must not be empty"),
        ({"guided_json": "[1, 2"}, "guided_json", "guided_json is not valid JSON"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
        (  # the schema would be ignored
            {"response_format": {"type": "json_object", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema",
            "goes with type json_schema",
        ),
        (
            {"response_format": {"type": "json_schema",
                                 "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
            "response_format.json_schema.strict",
            "must be a boolean",
        ),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs.structural_tag",
            "not supported",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(kw, param, match) -> None:
    with pytest.raises(OpenAIError, match=match) as info:
        _build(**kw)
    assert info.value.status_code == 400 and info.value.param == param


def test_unsupported_guided_knobs_are_refused_by_name() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for field, value in (
        ("guided_whitespace_pattern", " "),
        ("guided_decoding_backend", "outlines"),
        ("functions", []),
    ):
        with pytest.raises(OpenAIError) as info:
            ChatCompletionRequest.model_validate({**base, field: value})
        assert info.value.param == field


# -- tools -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "param", "match"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
        (None, "required", "tool_choice", "needs tools"),
        (TOOLS, "sometimes", "tool_choice", "must be"),
        ([{"type": "retrieval"}], None, "tools[0]", "must be"),
        (
            [{"type": "function", "function": {"name": "a b"}}],
            None,
            "tools[0].function.name",
            "must match",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
            None,
            "tools[0].function.parameters",
            "not a valid JSON schema",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(tools, choice, param, match) -> None:
    with pytest.raises(OpenAIError, match=match) as info:
        parse_tool_choice(tools, choice, None)
    assert info.value.param == param


def test_required_and_named_constrain_to_the_tools_schemas() -> None:
    required = parse_tool_choice(TOOLS, "required", False)
    assert required is not None
    src = required.constraint()
    assert src is not None and src.param == "tool_choice"
    schema = src.value
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    for bad in (
        [],
        [{"name": "add", "parameters": {"a": 1}}],
        [{"name": "get_weather", "parameters": {"city": "x"}}] * 2,
    ):  # maxItems 1
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = parse_tool_choice(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert named is not None and named.constraint().value == TOOLS[1]["function"]["parameters"]
    assert parse_tool_choice(TOOLS, None, None).mode == "auto"
    none = parse_tool_choice(TOOLS, "none", None)
    assert not none.render_tools and none.constraint() is None


def _parse(choice, pieces: list[str]):
    parser = ToolCallParser(choice)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    return content, [(c.name, json.loads(c.arguments)) for c in parser.calls], deltas


AUTO_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    "</tool_call>"
)


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(AUTO_TEXT)])
def test_hermes_parser_is_split_invariant(step) -> None:
    choice = parse_tool_choice(TOOLS, "auto", None)
    pieces = [AUTO_TEXT[i : i + step] for i in range(0, len(AUTO_TEXT), step)]
    content, calls, deltas = _parse(choice, pieces)
    assert content.strip() == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert "<tool" not in content  # nothing of a block leaks into the content


def test_hermes_parser_keeps_what_is_not_a_call_as_content() -> None:
    choice = parse_tool_choice(TOOLS, "auto", None)
    content, calls, _ = _parse(choice, ["a < b and <tool_call>not json</tool_call> ok"])
    assert calls == [] and content == "a < b and <tool_call>not json</tool_call> ok"
    content, calls, _ = _parse(choice, ['<tool_call>{"name": "add", "arguments": {"a": 1}}'])
    assert calls == [("add", {"a": 1})] and content == ""  # EOS before </tool_call>
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls, _ = _parse(choice, [unknown])
    assert calls == [] and content == unknown  # not one of the request's tools
    single = parse_tool_choice(TOOLS, "auto", False)
    _, calls, _ = _parse(single, [AUTO_TEXT])
    assert [c[0] for c in calls] == ["get_weather"]  # parallel_tool_calls=false: one call


def test_required_and_named_outputs_become_calls() -> None:
    required = parse_tool_choice(TOOLS, "required", None)
    text = json.dumps([{"name": "add", "parameters": {"a": 1, "b": 2}}])
    content, calls, _ = _parse(required, [text[:5], text[5:]])
    assert calls == [("add", {"a": 1, "b": 2})] and content == ""
    content, calls, _ = _parse(required, ['[{"name": "ad'])  # cut short: no call, no text
    assert calls == [] and content == ""
    named = parse_tool_choice(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    content, calls, deltas = _parse(named, ['{"a": 1,', ' "b": 2}'])
    assert calls == [("add", {"a": 1, "b": 2})] and content == ""
    assert [d.arguments for d in deltas] == ['{"a": 1,', ' "b": 2}', ""]
    assert finish_reason_with_calls("stop", True) == "tool_calls"
    assert finish_reason_with_calls("length", True) == "length"
    assert finish_reason_with_calls("stop", False) == "stop"


@pytest.mark.parametrize("cut", ["", ",", ", ", ', {"name": "add", "param', ", {", ",\n"])
def test_a_required_list_cut_short_keeps_its_complete_calls(cut) -> None:
    """Bug: a call list cut by max_tokens answered no calls and its partial JSON as
    content, dropping the calls it had completed."""
    required = parse_tool_choice(TOOLS, "required", None)
    done = [{"name": "add", "parameters": {"b": 2, "a": 1}},
            {"name": "get_weather", "parameters": {"city": "Paris"}}]
    text = " [" + ", ".join(json.dumps(c) for c in done) + cut
    content, calls, _ = _parse(required, [text])
    assert content == ""
    assert calls == [(c["name"], c["parameters"]) for c in done]
    parser = ToolCallParser(required)
    parser.feed(text)
    parser.finish()
    assert [c.arguments for c in parser.calls] == ['{"b": 2, "a": 1}', '{"city": "Paris"}']


def test_complete_array_items() -> None:
    assert complete_array_items('[{"a": 1}, {"b": 2}]') == [{"a": 1}, {"b": 2}]
    assert complete_array_items('\n[ {"a": 1} ,\n{"b": 2') == [{"a": 1}]
    assert complete_array_items("[1, 23") == [1]  # the cut number may be longer
    for text in ("", "[", "[]", '[{"a"', "{}", "no"):
        assert complete_array_items(text) == [], text


# -- chat template -----------------------------------------------------------------------------


def test_shipped_template_renders_tools_and_turns_like_the_model_without() -> None:
    tok = load_tokenizer()
    template = load_shipped_template("hermes_tool_use")
    plain = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True, chat_template=template
    )
    turns = plain + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = tok.apply_chat_template(
        turns, tools=TOOLS, tokenize=False, add_generation_prompt=True, chat_template=template
    )
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_flags(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("hermes_tool_use") == load_shipped_template("hermes_tool_use")
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template("/no/such/file.jinja")
    ns = build_parser().parse_args(
        ["--colocated", "h:1", "--chat-template", str(path), "--tool-call-parser", "hermes"]
    )
    cfg = RouterConfig.from_args(ns, {})
    assert (cfg.chat_template, cfg.tool_call_parser) == (str(path), "hermes")


_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        "\nHello\n" + _CALL + "\n",  # the leading newline was streamed, not in the answer
        "\n\n" + _CALL,
        "  Plain answer, no call.  ",
        "\n \n",
        "Before\n" + _CALL + "\nafter\n",
    ],
)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_tool_answer_equals_the_whole_one(text, step) -> None:
    from tandem.services.router import protocol as P
    from tandem.services.router.chat_streamers import ChatStreamer as _ChatStreamer
    from tandem.services.router.openai_routes import chat_message as _chat_message
    from tandem.services.router.sequence import SeqDelta

    choice = parse_tool_choice(TOOLS, "auto", None)
    req = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    whole, finish = _chat_message(text, "stop", choice)
    streamer = _ChatStreamer(None, req, "id", 1, choice)  # type: ignore[arg-type]
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    content, names, last = "", [], None
    for i, piece in enumerate(pieces):
        done = "stop" if i == len(pieces) - 1 else None
        assert streamer.parsers is not None
        _, c, entries, last = streamer.parsers[0].feed(SeqDelta(0, piece, [],
                                                                finish_reason=done))
        content += c or ""
        names += [e["function"]["name"] for e in entries or [] if "name" in e["function"]]
    assert content == (whole.content or "")
    assert names == [c["function"]["name"] for c in whole.tool_calls or []]
    assert last == finish


def test_constraints_and_tools_are_checked_off_the_event_loop() -> None:
    """A large schema's metaschema check (pure Python) ran on the router's event loop and
    stalled every other request for seconds; requests with such fields run it on a
    worker thread, plain ones stay on the loop (no thread hop)."""
    import asyncio
    import threading

    from tandem.services.router import protocol as P
    from tandem.services.router.openai_routes import off_loop as _off_loop

    loop_thread: list[int] = []

    async def where(req) -> int:
        loop_thread.append(threading.get_ident())
        return await _off_loop(req, threading.get_ident)

    msgs = [{"role": "user", "content": "x"}]
    constrained = P.ChatCompletionRequest(messages=msgs, response_format={"type": "json_object"})
    with_tools = P.ChatCompletionRequest(messages=msgs, tools=TOOLS)
    plain = P.ChatCompletionRequest(messages=msgs)
    for req, off in ((constrained, True), (with_tools, True), (plain, False)):
        ran_on = asyncio.run(where(req))
        assert (ran_on != loop_thread[-1]) == off


def test_a_busy_grammar_compiler_is_a_503_in_the_clients_words() -> None:
    """Every instance answering RESOURCE_EXHAUSTED for a saturated grammar compiler was a
    503 "no prefill instance could serve the request: RESOURCE_EXHAUSTED
    structured_outputs.regex: ..." with no param; it names the client's field now."""
    import grpc
    from grpc.aio import Metadata

    from tandem.contracts.role import Role
    from tandem.services.common.errors import FIELD_METADATA_KEY
    from tandem.services.router.retries import unavailable_error

    busy = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(),
        Metadata((FIELD_METADATA_KEY, "structured_outputs.regex")),
        details="structured_outputs.regex: the grammar compiler is busy (...); retry later")
    err = unavailable_error(Role.PREFILL, busy, {"structured_outputs.regex": "guided_regex"})
    assert (err.status_code, err.param, err.retry_after_s) == (503, "guided_regex", 1)
    assert err.message == "guided_regex: the grammar compiler is busy (...); retry later"
    down = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(),
                                details="connection refused")
    err = unavailable_error(Role.DECODE, down, {})
    assert err.status_code == 503 and err.param is None
    assert err.message.startswith("no decode instance could serve the request")
