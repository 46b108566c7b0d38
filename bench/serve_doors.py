"""The router's front doors as `tandem bench serve` speaks them (``--endpoint-type``): each
door's request body and the reading of its streamed events into one request's
measurements, so every door is timed the same way (TTFT at the first text event, ITL
between text events, output tokens from the door's own final usage).

- ``completions``: ``/v1/completions`` with ``prompt: [ids]``; a token event is a chunk
  with a choice; usage ``completion_tokens``.
- ``chat``: ``/v1/chat/completions`` with one user message; a token event is a chunk whose
  delta carries ``content`` (or ``reasoning_content``); usage ``completion_tokens``.
- ``responses``: ``/v1/responses`` (OpenAI Responses API) with ``input`` the prompt text and
  ``store: false`` (chat keeps nothing either); a token event is
  ``response.output_text.delta``; usage from the final ``response.completed`` /
  ``response.incomplete`` event's ``response.usage``.
- ``messages``: ``/v1/messages`` (Anthropic Messages API); a token event is a
  ``content_block_delta`` with a ``text_delta``; input tokens from ``message_start``
  (``input_tokens`` + ``cache_read_input_tokens``), output tokens from ``message_delta``.

The output length: completions and chat take vLLM's ``ignore_eos``; the Responses and
Messages doors refuse it and ``min_tokens`` alike (a 400 naming the field: their request
models forbid unknown fields), so ``--ignore-eos`` is refused for them and ``--structured
json`` (``structured_outputs``, which every door takes) is the way to force each output to
its ``max_tokens`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # serve_client runs the doors: a runtime import would be circular
    from tandem.bench.serve_client import RequestResult

#: ``--endpoint-type`` values, in the order the flag lists them.
ENDPOINT_TYPES = ("completions", "chat", "responses", "messages")


class DoorError(Exception):
    """An error event in a stream (the request failed after its 200)."""


@dataclass(frozen=True)
class Door:
    """How one endpoint type is spoken.

    Attributes:
        name: the ``--endpoint-type`` value.
        path: the door's default URL path.
        takes_ids: prompts go as token ids (else as the text they decode to).
        takes_ignore_eos: the door accepts vLLM's ``ignore_eos``.
        body: ``(model, prompt, max_tokens, temperature, ignore_eos) -> JSON body`` of a
            streamed request.
        read: reads one event's JSON payload into the result (usage, timings); returns
            the text of a token event, ``None`` for any other event. Raises
            :class:`DoorError` on an error event.
    """

    name: str
    path: str
    takes_ids: bool
    takes_ignore_eos: bool
    body: Callable[[str, list[int] | str, int, float, bool], dict[str, Any]]
    read: Callable[[dict[str, Any], RequestResult], str | None]


def _openai_error(data: dict[str, Any]) -> None:
    if "error" in data:
        raise DoorError(str(data["error"].get("message")))


def _openai_usage(data: dict[str, Any], res: RequestResult) -> None:
    if data.get("usage"):
        res.output_tokens = data["usage"]["completion_tokens"]
    if data.get("timings"):
        res.timings = data["timings"]


def _completions_body(model: str, prompt: list[int] | str, max_tokens: int,
                      temperature: float, ignore_eos: bool) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True}}


def _completions_read(data: dict[str, Any], res: RequestResult) -> str | None:
    _openai_error(data)
    _openai_usage(data, res)
    choices = data.get("choices") or ()
    # NOTE: any chunk with a choice is a token event, as before the doors existed.
    return "".join(c.get("text") or "" for c in choices) if choices else None


def _chat_body(model: str, prompt: list[int] | str, max_tokens: int, temperature: float,
               ignore_eos: bool) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_completion_tokens": max_tokens, "temperature": temperature,
            "stream": True, "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True}}


def _chat_read(data: dict[str, Any], res: RequestResult) -> str | None:
    _openai_error(data)
    _openai_usage(data, res)
    if data.get("usage"):
        res.prompt_len = data["usage"]["prompt_tokens"]
    texts = []
    for choice in data.get("choices") or ():
        delta = choice.get("delta") or {}
        texts += [t for t in (delta.get("reasoning_content"), delta.get("content")) if t]
    # the role-only first chunk and the finish chunk carry no text: not token events
    return "".join(texts) if texts else None


def _responses_body(model: str, prompt: list[int] | str, max_tokens: int,
                    temperature: float, ignore_eos: bool) -> dict[str, Any]:
    assert not ignore_eos, "the Responses door refuses ignore_eos"
    return {"model": model, "input": prompt, "max_output_tokens": max_tokens,
            "temperature": temperature, "stream": True, "store": False}


def _responses_read(data: dict[str, Any], res: RequestResult) -> str | None:
    kind = data.get("type")
    if kind == "response.output_text.delta":
        return str(data["delta"])
    if kind == "error":
        raise DoorError(str(data.get("message")))
    response = data.get("response") or {}
    if kind == "response.failed":
        raise DoorError(str((response.get("error") or {}).get("message")))
    if response.get("usage"):
        res.prompt_len = response["usage"]["input_tokens"]
        res.output_tokens = response["usage"]["output_tokens"]
    return None


def _messages_body(model: str, prompt: list[int] | str, max_tokens: int, temperature: float,
                   ignore_eos: bool) -> dict[str, Any]:
    assert not ignore_eos, "the Messages door refuses ignore_eos"
    return {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": temperature, "stream": True}


def _messages_read(data: dict[str, Any], res: RequestResult) -> str | None:
    kind = data.get("type")
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        return str(delta["text"]) if delta.get("type") == "text_delta" else None
    if kind == "error":
        raise DoorError(str((data.get("error") or {}).get("message")))
    if kind == "message_start":
        u = data["message"]["usage"]
        res.prompt_len = u["input_tokens"] + u.get("cache_read_input_tokens", 0)
    elif kind == "message_delta":
        res.output_tokens = data["usage"]["output_tokens"]
    return None


DOORS = {
    "completions": Door("completions", "/v1/completions", True, True, _completions_body,
                        _completions_read),
    "chat": Door("chat", "/v1/chat/completions", False, True, _chat_body, _chat_read),
    "responses": Door("responses", "/v1/responses", False, False, _responses_body,
                      _responses_read),
    "messages": Door("messages", "/v1/messages", False, False, _messages_body,
                     _messages_read),
}
assert tuple(DOORS) == ENDPOINT_TYPES, "every endpoint type has its door"
