"""Anthropic's Messages API (``POST /v1/messages``) as a chat request, and its answer's shape.

A Messages request is translated into the router's ``ChatCompletionRequest`` (the one chat
pipeline serves both): ``system`` (a string or text blocks) -> a system message;
``messages`` -> chat messages (``text`` blocks -> content, an assistant's ``tool_use``
blocks -> its ``tool_calls``, a user's ``tool_result`` blocks -> ``tool`` messages before
its text); ``tools`` (``name``, ``description``, ``input_schema``) -> function tools;
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> chat's ``auto`` / ``required`` /
named / ``none`` (``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``);
``stop_sequences`` -> ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` as
they are. Anything else is a 400 naming it: an unknown field, a block of another type
(images, documents, thinking), server tools, ``thinking`` enabled. Source of the shapes:
Anthropic's API reference (Messages, Count tokens) and the ``anthropic`` client's types.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.services.router import protocol as P
from tandem.services.router.errors import OpenAIError, rename_field

_RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^max_completion_tokens"), "max_tokens"),
    (re.compile(r"^stop$"), "stop_sequences"),
)


def rename(param: str) -> str:
    """A chat request field's name in the Messages request's words."""
    return rename_field(param, _RENAMES)


class MessageParam(BaseModel):
    """One turn: ``role`` and ``content`` (a string or content blocks)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[MessageParam]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def chat_body(self) -> dict[str, Any]:
        """The chat request's fields this request sets.

        Raises:
            OpenAIError: 400 naming the field tandem does not take.
        """
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise OpenAIError("thinking is not supported", param="thinking")
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, m in enumerate(self.messages):
            messages += _turn(m, f"messages[{i}]")
        body: dict[str, Any] = {"messages": messages}
        if self.model is not None:
            body["model"] = self.model
        if self.tools is not None:
            body["tools"] = [_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body.update(_tool_choice(self.tool_choice))
        return body

    def to_chat(self) -> P.ChatCompletionRequest:
        """The chat request of this one. Raises: OpenAIError 400 naming the field."""
        return P.ChatCompletionRequest.model_validate(self.chat_body())


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: the fields tandem serves; any other is a 400 naming it."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    #: vLLM's structured outputs object, as chat takes it (e.g. ``disable_any_whitespace``)
    structured_outputs: dict[str, Any] | None = None
    # Fields that do not change the output.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def to_chat(self) -> P.ChatCompletionRequest:
        body = self.chat_body()
        body["max_completion_tokens"] = self.max_tokens
        body["stream"] = self.stream
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p", "top_k", "structured_outputs"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return P.ChatCompletionRequest.model_validate(body)


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, block in enumerate(content):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise OpenAIError(f"{where}[{j}].type: blocks of type {block.get('type')!r} are "
                              "not supported here (only text)", param=f"{where}[{j}].type")
        out.append(block["text"])
    return "".join(out)


def _turn(m: MessageParam, where: str) -> list[dict[str, Any]]:
    """One Messages turn as chat messages."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise OpenAIError(f"{at}: a tool_use block needs string id and name", param=at)
            if not isinstance(block.get("input"), dict):
                raise OpenAIError(f"{at}.input must be an object", param=f"{at}.input")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"],
                "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and m.role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise OpenAIError(f"{at}.tool_use_id must be a string",
                                  param=f"{at}.tool_use_id")
            content = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(content, f"{at}.content")})
        else:
            raise OpenAIError(f"{at}.type: {kind!r} blocks are not supported in a {m.role} "
                              "message", param=f"{at}.type")
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results
                      else [])


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise OpenAIError(f"tools[{i}].type: server tools such as {kind!r} are not supported "
                          "(only client tools with input_schema)", param=f"tools[{i}].type")
    unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
    if unknown:
        raise OpenAIError(f"tools[{i}]: unknown fields {sorted(unknown)}",
                          param=f"tools[{i}].{sorted(unknown)[0]}")
    if not isinstance(tool.get("input_schema"), dict):
        raise OpenAIError(f"tools[{i}].input_schema must be a JSON schema object",
                          param=f"tools[{i}].input_schema")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` of the chat request."""
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    if kind in ("auto", "none"):
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        raise OpenAIError(f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                          param="tool_choice.type")
    return out


class AnthropicErrorInfo(BaseModel):
    """The error object of Anthropic's error JSON (``errors.OpenAIError.to_anthropic``)."""

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every non-2xx answer under ``/v1/messages``: ``{"type": "error", "error": {...}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


#: The error statuses of the Messages routes, all as Anthropic's error JSON.
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": what} for status, what in (
        (400, "invalid request (the field named in the message)"),
        (401, "missing or wrong API key (x-api-key or Authorization: Bearer)"),
        (404, "unknown `model`"), (413, "body over --max-request-body-bytes"),
        (503, "no instance can serve, or the router's queue is full (Retry-After)"))}


def stop_reason(finish_reason: str | None, matched: int | str | None, has_calls: bool
                ) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` of a finished answer: ``tool_use``
    with calls, ``max_tokens`` when cut by it, ``stop_sequence`` (and which) when one of
    ``stop_sequences`` ended it, else ``end_turn``."""
    if has_calls and finish_reason != "length":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def message_usage(u: P.UsageInfo) -> dict[str, int]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt tokens computed, the ones
    served from a cache are ``cache_read_input_tokens`` (their sum is the prompt)."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (OpenAI form) as a ``tool_use`` block; arguments that are not a
    JSON object (a call cut short) become ``{}``."""
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
            "input": args if isinstance(args, dict) else {}}


def tool_use_id(call_id: str) -> str:
    """Anthropic's id form (``toolu_...``) of a tool call id."""
    return f"toolu_{call_id.removeprefix('call_')}"
