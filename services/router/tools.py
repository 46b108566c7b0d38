"""Tool calling for Chat Completions: the request's ``tools`` / ``tool_choice``, the constraint
a forced call implies, and the parser that turns the model's text into ``tool_calls``.

Modes (OpenAI's ``tool_choice``):

* ``none``: the tools are not shown to the model; its text is the answer.
* ``auto`` (the default with tools): the tools are rendered into the prompt by the chat
  template and the model chooses; its text is parsed by the ``hermes`` parser:
  every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block becomes a call,
  the text outside them the content. A block that is not such JSON, or names no tool
  of the request, stays content, so the answer is well formed either way.
* ``required``: the output is constrained (a JSON schema) to a JSON array of one or more
  ``{"name": <a tool's name>, "parameters": <its arguments>}`` objects (at most one with
  ``parallel_tool_calls: false``), so the calls always parse and their arguments validate
  against the tools' schemas (vLLM's scheme).
* a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to that function's parameters schema; the whole text is its arguments.

Imports no torch (the router runs it).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.structured_output.json_schema import check_json_schema
from tandem.engine.validation import RequestError
from tandem.services.router.errors import OpenAIError
from tandem.services.router.structured import ConstraintSource

#: OpenAI's rule for function names.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: The parsers ``--tool-call-parser`` offers (vLLM's names).
TOOL_CALL_PARSERS = ("hermes",)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    """One function tool.

    Attributes:
        name: the function's name.
        description: what it does (shown to the model), or ``None``.
        parameters: the JSON schema of its arguments (an object schema).
    """

    name: str
    description: str | None
    parameters: dict[str, Any]

    def to_template(self) -> dict[str, Any]:
        """The OpenAI form chat templates expect (``{"type": "function", "function": ...}``)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools and how they may be used.

    Attributes:
        tools: the functions, in request order.
        mode: ``"none"``, ``"auto"``, ``"required"`` or ``"named"``.
        name: the forced function (mode ``"named"``), else ``None``.
        parallel: whether several calls may be made in one answer.
    """

    tools: tuple[Tool, ...]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def render_tools(self) -> bool:
        """Whether the prompt lists the tools (every mode but ``none``)."""
        return self.mode != "none" and bool(self.tools)

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> ConstraintSource | None:
        """The constraint a forced call implies (``required``, named), else ``None``."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return ConstraintSource("tool_choice", "json", tool.parameters)
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.name]},
                        "parameters": t.parameters,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": items[0] if len(items) == 1 else {"anyOf": items},
            }
            if not self.parallel:
                schema["maxItems"] = 1
            return ConstraintSource("tool_choice", "json", schema)
        return None


def parse_tool_choice(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolChoice | None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

    Returns:
        ``None`` when the request has no tools.

    Raises:
        OpenAIError: 400 naming the field: a tool that is not a function, a bad name, a
            ``parameters`` that is not a valid JSON schema (jsonschema's message) or, for
            a tool whose call is constrained (``required``, named), one that uses a
            keyword the grammar backend does not enforce; a ``tool_choice`` without tools,
            of an unknown form, or naming an unknown function.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        return None
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(t.get("function"), dict)
        ):
            raise OpenAIError(
                f'{where} must be {{"type": "function", "function": {{...}}}}', param=where
            )
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise OpenAIError(
                f"{where}.function.name must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}",
                param=f"{where}.function.name",
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_parameters(params, f"{where}.function.parameters", enforced=False)
        desc = fn.get("description")
        parsed.append(Tool(name, desc if isinstance(desc, str) else None, params))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise OpenAIError("tools: function names must be unique", param="tools")
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice(tuple(parsed), "auto", parallel=parallel)
    if tool_choice in ("none", "required"):
        if tool_choice == "required":
            for i, t in enumerate(parsed):
                _check_parameters(t.parameters, f"tools[{i}].function.parameters")
        return ToolChoice(tuple(parsed), tool_choice, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise OpenAIError(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )
        i = names.index(name)
        _check_parameters(parsed[i].parameters, f"tools[{i}].function.parameters")
        return ToolChoice(tuple(parsed), "named", name=name, parallel=parallel)
    raise OpenAIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", '
        '"function": {"name": ...}}',
        param="tool_choice",
    )


def check_tool_messages(messages: Sequence[tuple[str, list[Any] | None, str | None]]) -> None:
    """The tool turns of a conversation: every assistant call well formed, every tool
    message answering a call made earlier.

    Args:
        messages: per message, ``(role, tool_calls, tool_call_id)``.

    Raises:
        OpenAIError: 400 naming the field: ``tool_calls`` on a message that is not the
            assistant's; a call without a string ``id``, with a ``type`` other than
            ``function``, without ``function.name``, or whose ``function.arguments`` is
            not a JSON object in a string (OpenAI's form); a tool message without
            ``tool_call_id`` or whose id matches no earlier call.
    """
    call_ids: set[str] = set()
    for i, (role, tool_calls, tool_call_id) in enumerate(messages):
        where = f"messages[{i}]"
        if tool_calls is not None and role != "assistant":
            raise OpenAIError(f"{where}.tool_calls: only assistant messages make tool calls",
                              param=f"{where}.tool_calls")
        for j, call in enumerate(tool_calls or ()):
            at = f"{where}.tool_calls[{j}]"
            if not isinstance(call, dict):
                raise OpenAIError(f"{at} must be an object", param=at)
            if not isinstance(call.get("id"), str) or not call["id"]:
                raise OpenAIError(f"{at}.id must be a non-empty string", param=f"{at}.id")
            if call.get("type", "function") != "function":
                raise OpenAIError(f"{at}.type must be \"function\"", param=f"{at}.type")
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise OpenAIError(f"{at}.function.name must be a string",
                                  param=f"{at}.function.name")
            args = fn.get("arguments")
            try:
                parsed = json.loads(args) if isinstance(args, str) else None
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise OpenAIError(
                    f"{at}.function.arguments must be a string holding a JSON object",
                    param=f"{at}.function.arguments",
                )
            call_ids.add(call["id"])
        if role == "tool":
            if not tool_call_id:
                raise OpenAIError(f"{where}: a tool message needs tool_call_id",
                                  param=f"{where}.tool_call_id")
            if tool_call_id not in call_ids:
                raise OpenAIError(
                    f"{where}.tool_call_id {tool_call_id!r} answers no tool call of an "
                    "earlier assistant message",
                    param=f"{where}.tool_call_id",
                )


def _check_parameters(params: Any, where: str, *, enforced: bool = True) -> None:
    try:
        check_json_schema(params, where, enforced=enforced)
    except RequestError as exc:
        raise OpenAIError(str(exc), param=where) from None


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON string, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_tool_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def _hermes_call(body: str) -> ToolCall | None:
    """The call in one ``<tool_call>`` block's body, or ``None`` when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class ParsedDelta:
    """What a piece of output adds to the answer."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    #: named mode: a piece of the one call's arguments (its first piece opens the call).
    arguments: str = ""


class ToolCallParser:
    """Turns one choice's text, fed incrementally, into content and tool calls.

    Args:
        choice: the request's tools and mode.

    Feed every text delta to :meth:`feed` and call :meth:`finish` once at the end; the
    returned deltas, concatenated, are the whole answer. Auto mode holds back text that
    may be the start of ``<tool_call>`` and everything inside a block until it closes.
    """

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._buf = ""
        self._inside = False
        self.calls: list[ToolCall] = []
        self.named_call: ToolCall | None = None
        self._text = ""

    def feed(self, text: str) -> ParsedDelta:
        mode = self.choice.mode
        if mode == "none":
            return ParsedDelta(content=text)
        if mode == "named":
            if text and self.named_call is None:
                assert self.choice.name is not None
                self.named_call = ToolCall(self.choice.name, "")
                self.calls.append(self.named_call)
            if self.named_call is not None:
                self.named_call.arguments += text
            return ParsedDelta(arguments=text)
        if mode == "required":
            self._text += text
            return ParsedDelta()
        return self._feed_auto(text)

    def _feed_auto(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while True:
            if not self._inside:
                at = self._buf.find(_OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, _OPEN)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._buf[:at]
                self._buf = self._buf[at + len(_OPEN) :]
                self._inside = True
            else:
                at = self._buf.find(_CLOSE)
                if at < 0:
                    return out
                body, self._buf = self._buf[:at], self._buf[at + len(_CLOSE) :]
                self._inside = False
                self._add_block(body, out)

    def _known(self, call: ToolCall | None) -> ToolCall | None:
        """``call`` if it names one of the request's tools (else it is not a call)."""
        if call is None or call.name not in {t.name for t in self.choice.tools}:
            return None
        return call

    def _add_block(self, body: str, out: ParsedDelta) -> None:
        call = self._known(_hermes_call(body.strip()))
        if call is None or (self.calls and not self.choice.parallel):
            out.content += _OPEN + body + _CLOSE  # not a call: it stays text
            return
        self.calls.append(call)
        out.calls.append(call)

    def finish(self) -> ParsedDelta:
        """The rest at the end of the output (an unclosed block, the required array)."""
        mode = self.choice.mode
        out = ParsedDelta()
        if mode == "required":
            # NOTE: a list cut short (length) keeps the calls it completed; the rest of
            # the text is half a call, which is neither content nor a call. The finish
            # reason ("length") says the answer was cut, as OpenAI's does.
            for it in complete_array_items(self._text):
                if not isinstance(it, dict) or not isinstance(it.get("name"), str):
                    break
                call = ToolCall(
                    it["name"], json.dumps(it.get("parameters", {}), ensure_ascii=False)
                )
                self.calls.append(call)
                out.calls.append(call)
            return out
        if mode == "auto":
            if self._inside:
                # The model stopped inside a block (EOS before </tool_call>).
                last = self._known(_hermes_call(self._buf.strip()))
                if last is not None and (not self.calls or self.choice.parallel):
                    self.calls.append(last)
                    out.calls.append(last)
                else:
                    out.content = _OPEN + self._buf
            else:
                out.content = self._buf
            self._buf = ""
        return out


_DECODER = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def complete_array_items(text: str) -> list[Any]:
    """The items of the JSON array ``text`` up to the first incomplete one: all of them
    for a whole array, those before the cut for one cut short (``[]`` when not even its
    first item is complete, or when ``text`` is no array)."""

    def skip_space(at: int) -> int:
        match = _JSON_SPACE.match(text, at)
        assert match is not None, "the pattern matches the empty string"
        return match.end()

    at = skip_space(0)
    if not text.startswith("[", at):
        return []
    items: list[Any] = []
    at = skip_space(at + 1)
    while not text.startswith("]", at):
        if items:
            if not text.startswith(",", at):
                return items
            at = skip_space(at + 1)
        try:
            item, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return items
        if at == len(text) and isinstance(item, (int, float)):
            return items  # a number at the cut may have lost digits
        items.append(item)
        at = skip_space(at)
    return items


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def finish_reason_with_calls(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the answer holds calls and ended normally."""
    return "tool_calls" if has_calls and reason == "stop" else reason
