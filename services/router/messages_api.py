"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages API)
on the router's chat pipeline (``messages_protocol`` translates the request). Errors under
these paths are Anthropic's JSON (``errors.OpenAIError.to_anthropic``); the API key is
taken from ``x-api-key`` as from ``Authorization: Bearer`` (``door.Door.check_auth``).

``stream: true`` sends Anthropic's events, each as ``event: <type>`` plus its JSON:
``message_start`` (the message with empty content and the input usage), per content block
``content_block_start``, ``content_block_delta``... (``text_delta`` for text,
``input_json_delta`` for a ``tool_use`` block's input, ``thinking_delta`` for a
``thinking`` block, which holds the thinking split off by the router's reasoning parser,
with an empty ``signature``), ``content_block_stop``; then
``message_delta`` (``stop_reason``, ``stop_sequence``, the output usage) and
``message_stop``. A failure after the stream began is an ``error`` event.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.services.router import messages_protocol as M
from tandem.services.router import openapi
from tandem.services.router.chat_streamers import ChatDeltaParser
from tandem.services.router.door import Door, renamed
from tandem.services.router.errors import OpenAIError
from tandem.services.router.openai_routes import PreparedChat, chat_message, prepare_chat
from tandem.services.router.responses import ChoiceState, usage
from tandem.services.router.sequence import SeqDelta
from tandem.services.router.streaming import CLIENT_GONE, Chunk, Streamer, collect, stream


def install(app: FastAPI, door: Door) -> None:
    """Add the Messages API routes to ``app``."""
    fe = door.fe

    @app.post("/v1/messages", openapi_extra=openapi.request_body(M.MessagesRequest),
              responses={**M.ERRORS, **openapi.typed_events(
                  "the message; with `stream: true` server-sent events (`message_start`, "
                  "content block events, `message_delta`, `message_stop`)")})
    async def create(request: Request) -> Response:
        rid, arrival_ns, req = await door.accept(request, M.MessagesRequest)
        try:
            chat = await prepare_chat(fe, req.to_chat(), rid, arrival_ns, rename=M.rename)
        except OpenAIError as exc:
            raise renamed(exc, M.rename) from None
        msg_id = f"msg_{rid}"
        model = req.model or fe.model_name
        if req.stream:
            return await stream(request, rid, door.generate(request, [chat.gen]),
                                _MessagesStreamer(chat, msg_id, model), door.drain)
        states = await collect(request, rid, door.generate(request, [chat.gen]), 1, door.drain)
        if states is None:
            return Response(status_code=CLIENT_GONE)
        st = states[0]
        message, _ = chat_message(st.text, st.finish_reason, chat.parses, chat.reasoning)
        content: list[dict[str, Any]] = []
        if message.reasoning_content:
            content.append({"type": "thinking", "thinking": message.reasoning_content,
                            "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        content += [M.tool_use_block(c) for c in message.tool_calls or ()]
        reason, sequence = M.stop_reason(st.finish_reason, st.stop_reason,
                                         bool(message.tool_calls))
        body = {"id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": M.message_usage(usage(chat.num_prompt_tokens, states, 1))}
        return JSONResponse(body, headers={"request-id": rid, "X-Request-Id": rid})

    @app.post("/v1/messages/count_tokens",
              openapi_extra=openapi.request_body(M.CountTokensRequest), responses=M.ERRORS)
    async def count_tokens(request: Request) -> JSONResponse:
        _, _, req = await door.accept(request, M.CountTokensRequest)
        try:
            chat_req = req.to_chat()
            tool_choice = chat_req.tool_choice_spec()
        except OpenAIError as exc:
            raise renamed(exc, M.rename) from None
        tools = ([t.to_template() for t in tool_choice.tools]
                 if tool_choice is not None and tool_choice.render_tools else None)
        ids = fe.apply_chat_template([m.to_template() for m in chat_req.messages],
                                     tools=tools)
        return JSONResponse({"input_tokens": len(ids)})


class _MessagesStreamer(Streamer):
    """The events of one streamed message (see the module docstring)."""

    def __init__(self, chat: PreparedChat, msg_id: str, model: str) -> None:
        self.num_prompt_tokens = chat.num_prompt_tokens
        self.msg_id = msg_id
        self.model = model
        self.parser = ChatDeltaParser(chat.parses, chat.reasoning)
        self.state = ChoiceState(index=0)
        self.started = False
        self.num_blocks = 0
        self.open: str | None = None  # the open block's type: "thinking", "text", "tool_use"
        self.has_calls = False

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        self.num_blocks += 1
        return [self._event("content_block_stop", index=self.num_blocks - 1)]

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.open = block["type"]
        out.append(self._event("content_block_start", index=self.num_blocks,
                               content_block=block))
        return out

    def chunks(self, idx: int, d: SeqDelta) -> list[Chunk]:
        out: list[Chunk] = []
        if not self.started:
            self.started = True
            cached = d.num_cached_tokens
            out.append(self._event("message_start", message={
                "id": self.msg_id, "type": "message", "role": "assistant",
                "model": self.model, "content": [], "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": self.num_prompt_tokens - cached, "output_tokens": 0,
                          "cache_read_input_tokens": cached,
                          "cache_creation_input_tokens": 0}}))
        self.state.add(d)
        reasoning, content, entries, _ = self.parser.feed(d)
        if reasoning:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._event("content_block_delta", index=self.num_blocks,
                                   delta={"type": "thinking_delta", "thinking": reasoning}))
        if content:
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._event("content_block_delta", index=self.num_blocks,
                                   delta={"type": "text_delta", "text": content}))
        for entry in entries or ():
            fn = entry["function"]
            if "id" in entry:
                self.has_calls = True
                out += self._start({"type": "tool_use", "id": M.tool_use_id(entry["id"]),
                                    "name": fn["name"], "input": {}})
            if fn.get("arguments"):
                out.append(self._event("content_block_delta", index=self.num_blocks,
                                       delta={"type": "input_json_delta",
                                              "partial_json": fn["arguments"]}))
        return out

    async def final(self) -> list[str]:
        out = self._close()
        st = self.state
        reason, sequence = M.stop_reason(st.finish_reason, st.stop_reason, self.has_calls)
        u = M.message_usage(usage(self.num_prompt_tokens, [st], 1))
        out.append(self._event("message_delta",
                               delta={"stop_reason": reason, "stop_sequence": sequence},
                               usage={"output_tokens": u["output_tokens"]}))
        out.append(self._event("message_stop"))
        return out

    def error_event(self, err: OpenAIError) -> str:
        body = err.to_anthropic()
        return self._event("error", error=body["error"])

    def done(self) -> str:
        return ""
