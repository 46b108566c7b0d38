"""OpenAI's Responses API (``POST /v1/responses``) as a chat request, and its answer's shape.

A Responses request is translated into the router's ``ChatCompletionRequest`` (the one
chat pipeline serves both): ``instructions`` -> a system message; ``input`` (a string, or
items: ``message`` with text parts, ``function_call``, ``function_call_output``) -> chat
messages, after those of the ``previous_response_id`` conversation; function ``tools`` and
``tool_choice`` -> chat's; ``text.format`` -> ``response_format``; ``max_output_tokens``
-> ``max_completion_tokens``; sampling fields as they are (vLLM's extras too). Anything
else is a 400 naming it: an unknown field, a built-in tool (``web_search``,
``file_search``, ``code_interpreter``, ``computer_use_preview``, ...), an item or content
part of another type (images, files, reasoning, item references), ``background``,
``include``, ``reasoning``, ``truncation: "auto"``. Source of the shapes: the OpenAI API
reference (Responses) and the ``openai`` client's types.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.services.router import protocol as P
from tandem.services.router.errors import OpenAIError, rename_field

#: Input item types taken (``type`` may be left out of a message item).
_ITEM_TYPES = ("message", "function_call", "function_call_output")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
#: Chat field name -> the Responses field that set it (for errors naming it).
_RENAMES = (
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^messages"), "input"),
)


def rename(param: str) -> str:
    """A chat request field's name in the Responses request's words."""
    return rename_field(param, _RENAMES)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: the fields tandem serves; any other is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    include: list[str] | None = Field(None, max_length=0)
    reasoning: dict[str, Any] | None = None
    top_logprobs: Literal[0] | None = None
    # Fields that do not change the output: accepted, echoed where OpenAI echoes them.
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    priority: int | None = None
    #: vLLM's structured outputs object, as chat takes it (e.g. ``disable_any_whitespace``)
    structured_outputs: dict[str, Any] | None = None

    def check(self) -> None:
        """Raises: OpenAIError 400 naming a field whose value tandem does not serve."""
        if self.reasoning is not None and any(v is not None for v in self.reasoning.values()):
            raise OpenAIError("reasoning options are not supported", param="reasoning")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")

    def to_chat(self, history: list[dict[str, Any]]) -> P.ChatCompletionRequest:
        """The chat request of this one, its conversation after ``history`` (the chat
        messages of the ``previous_response_id`` conversation, ``[]`` for none).

        Raises:
            OpenAIError: 400 naming the field (in chat's words; ``rename`` turns them into
                this API's).
        """
        self.check()
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += history + input_messages(self.input)
        body: dict[str, Any] = {"messages": messages, "stream": self.stream}
        if self.model is not None:
            body["model"] = self.model
        if self.tools is not None:
            body["tools"] = [_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.text is not None:
            rf = _response_format(self.text)
            if rf is not None:
                body["response_format"] = rf
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed", "stop", "priority",
                     "parallel_tool_calls", "structured_outputs"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return P.ChatCompletionRequest.model_validate(body)


def _text(content: Any, where: str) -> str:
    """The text of a message's ``content`` (a string or text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}[{j}].type: content parts of type {kind!r} are not "
                              "supported (only text)", param=f"{where}[{j}].type")
        out.append(part["text"])
    return "".join(out)


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive ``function_call`` items join one assistant
    message's ``tool_calls`` (with the assistant text before them, if any).

    Raises:
        OpenAIError: 400 naming ``input[i]...`` for an item or part tandem does not take.
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise OpenAIError(f"{where}.type: input items of type {kind!r} are not supported "
                              f"(only {', '.join(_ITEM_TYPES)})", param=f"{where}.type")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise OpenAIError(f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                  f"{role!r}", param=f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"),
                                                            f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise OpenAIError(f"{where}.{key} must be a string", param=f"{where}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            if not isinstance(item.get("call_id"), str):
                raise OpenAIError(f"{where}.call_id must be a string", param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
    return messages


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise OpenAIError(f"tools[{i}].type: built-in tools such as {kind!r} are not "
                          "supported (only function tools)", param=f"tools[{i}].type")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise OpenAIError(f"tools[{i}]: unknown fields {sorted(unknown)}",
                          param=f"tools[{i}].{sorted(unknown)[0]}")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
          if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise OpenAIError(f"tool_choice of type {choice.get('type')!r} is not supported (only "
                      '"none", "auto", "required" or {"type": "function", "name": ...})',
                      param="tool_choice")


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    unknown = {k for k, v in text.items() if k != "format" and v is not None}
    if unknown:
        raise OpenAIError(f"text.{sorted(unknown)[0]} is not supported",
                          param=f"text.{sorted(unknown)[0]}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    raise OpenAIError(f"text.format.type must be text, json_object or json_schema, got "
                      f"{kind!r}", param="text.format.type")


def output_items(message: P.ChatResponseMessage, msg_id: str) -> list[dict[str, Any]]:
    """A whole answer's ``output``: a ``reasoning`` item with the thinking (when any), a
    ``message`` item with its text (when any), then one ``function_call`` item per call."""
    items: list[dict[str, Any]] = []
    if message.reasoning_content:
        items.append(reasoning_item(f"rs_{msg_id.removeprefix('msg_')}",
                                    message.reasoning_content, "completed"))
    if message.content:
        items.append(message_item(msg_id, message.content, "completed"))
    for call in message.tool_calls or ():
        fn = call["function"]
        items.append(function_call_item(call["id"], fn["name"], fn["arguments"], "completed"))
    return items


def message_item(msg_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant ``message`` output item (``text`` ``None``: no content part yet)."""
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A ``reasoning`` output item holding the thinking as one ``reasoning_text`` part
    (``text`` ``None``: no part yet); no summary and no encrypted content."""
    content = [] if text is None else [reasoning_text(text)]
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": content, "encrypted_content": None}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str
                       ) -> dict[str, Any]:
    """A ``function_call`` output item; its ``id`` is derived from the call's id."""
    return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}",
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def history_of(chat: P.ChatCompletionRequest, items: list[dict[str, Any]],
               instructions: str | None) -> list[dict[str, Any]]:
    """The conversation a stored response continues with: the request's chat messages
    (without its ``instructions``, which a next turn does not inherit) and the answer."""
    messages = [m.to_template() for m in chat.messages]
    if instructions:
        messages = messages[1:]
    text = "".join(c["text"] for it in items if it["type"] == "message" for c in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    answer: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        answer["tool_calls"] = calls
    return [*messages, answer]


def response_body(req: ResponsesRequest, resp_id: str, created_at: int, model: str,
                  items: list[dict[str, Any]], status: str, finish_reason: str | None,
                  u: P.UsageInfo | None) -> dict[str, Any]:
    """The Response object (``object: "response"``) with ``output`` ``items``.

    ``status`` is ``in_progress`` while streaming, ``incomplete`` (with
    ``incomplete_details.reason`` ``max_output_tokens``) for an answer cut by its token
    limit, else ``completed``.
    """
    if status != "in_progress" and finish_reason == "length":
        status = "incomplete"
    usage = None
    if u is not None:
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        usage = {"input_tokens": u.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": cached},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": u.total_tokens}
    text_format = (req.text or {}).get("format") or {"type": "text"}
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": model, "output": items,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": None,
        "store": req.store, "temperature": req.temperature,
        "text": {"format": text_format}, "tool_choice": tool_choice,
        "tools": req.tools or [], "top_p": req.top_p, "truncation": "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


def now_s() -> int:
    return int(time.time())


def dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
