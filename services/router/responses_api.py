"""``POST /v1/responses`` and ``GET /v1/responses/{response_id}`` (OpenAI's Responses API)
on the router's chat pipeline (``responses_protocol`` translates the request).

``stream: true`` sends OpenAI's typed events, each as ``event: <type>`` plus its JSON with
a ``sequence_number`` counting from 0: ``response.created``, ``response.in_progress``; per
text item ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per function call
``response.output_item.added``, ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, ``response.output_item.done``; with a
reasoning parser, the thinking first as a ``reasoning`` item (``response.output_item.added``,
``response.content_part.added``, ``response.reasoning_text.delta``...,
``response.reasoning_text.done``, ``response.content_part.done``,
``response.output_item.done``); then
``response.completed`` (``response.incomplete`` for an answer cut by
``max_output_tokens``) with the whole response. A failure after the stream began is an
``error`` event. There is no ``[DONE]``.

``store`` (default true) keeps the response and its conversation in the ``ResponseStore``
for its TTL; ``previous_response_id`` continues that conversation (a 404
``previous_response_not_found`` when it was never stored, was stored with
``store: false``, or expired).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.services.router import openapi
from tandem.services.router import protocol as P
from tandem.services.router import responses_protocol as R
from tandem.services.router.chat_streamers import ChatDeltaParser
from tandem.services.router.door import Door, renamed
from tandem.services.router.errors import OpenAIError
from tandem.services.router.openai_routes import PreparedChat, chat_message, prepare_chat
from tandem.services.router.response_store import ResponseStore
from tandem.services.router.responses import ChoiceState, usage
from tandem.services.router.sequence import SeqDelta
from tandem.services.router.streaming import CLIENT_GONE, Chunk, Streamer, collect, stream

logger = logging.getLogger(__name__)


def install(app: FastAPI, door: Door, store: ResponseStore) -> None:
    """Add the Responses API routes to ``app``; stored responses live in ``store``."""
    fe = door.fe

    async def load(response_id: str, param: str | None) -> dict[str, Any]:
        try:
            record = await store.get(response_id)
        except Exception as exc:  # noqa: BLE001 - the store's client raises its own types
            logger.warning("response store unreachable: %s", exc)
            raise OpenAIError("the response store is unavailable", status_code=503,
                              retry_after_s=1) from exc
        if record is None:
            raise OpenAIError(f"Response with id '{response_id}' not found (never stored, "
                              "stored with store=false, or expired).", status_code=404,
                              param=param, code="previous_response_not_found"
                              if param else "response_not_found")
        return record

    async def keep(resp_id: str, body: dict[str, Any], history: list[dict[str, Any]]) -> None:
        try:
            await store.put(resp_id, {"response": body, "messages": history})
        except Exception as exc:  # noqa: BLE001 - the store's client raises its own types
            logger.warning("could not store response %s: %s", resp_id, exc)

    @app.post("/v1/responses", openapi_extra=openapi.request_body(R.ResponsesRequest),
              responses={**openapi.GENERATION_ERRORS, **openapi.typed_events(
                  "the response; with `stream: true` server-sent events of typed response "
                  "events (`response.created` ... `response.completed`)")})
    async def create(request: Request) -> Response:
        rid, arrival_ns, req = await door.accept(request, R.ResponsesRequest)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = (await load(req.previous_response_id, "previous_response_id"))["messages"]
        try:
            chat_req = req.to_chat(history)
            chat = await prepare_chat(fe, chat_req, rid, arrival_ns, rename=R.rename)
        except OpenAIError as exc:
            raise renamed(exc, R.rename) from None
        resp_id = f"resp_{rid}"
        model = req.model or fe.model_name
        if req.stream:
            return await stream(request, rid, door.generate(request, [chat.gen]),
                                _ResponsesStreamer(req, chat_req, chat, resp_id, model, keep),
                                door.drain)
        states = await collect(request, rid, door.generate(request, [chat.gen]), 1, door.drain)
        if states is None:
            return Response(status_code=CLIENT_GONE)
        st = states[0]
        message, _ = chat_message(st.text, st.finish_reason, chat.parses, chat.reasoning)
        items = R.output_items(message, f"msg_{uuid.uuid4().hex}")
        body = R.response_body(req, resp_id, R.now_s(), model, items, "completed",
                               st.finish_reason, usage(chat.num_prompt_tokens, states, 1))
        if req.store:
            await keep(resp_id, body, R.history_of(chat_req, items, req.instructions))
        return JSONResponse(body, headers={"X-Request-Id": rid})

    @app.get("/v1/responses/{response_id}", responses={
        401: openapi.GENERATION_ERRORS[401],
        404: {"model": P.ErrorResponse, "description": "no such stored response"},
        503: {"model": P.ErrorResponse, "description": "the response store is unreachable"}})
    async def retrieve(request: Request, response_id: str) -> JSONResponse:
        door.check_auth(request)
        return JSONResponse((await load(response_id, None))["response"])


class _ResponsesStreamer(Streamer):
    """The typed events of one streamed response (see the module docstring)."""

    def __init__(self, req: R.ResponsesRequest, chat_req: P.ChatCompletionRequest,
                 chat: PreparedChat, resp_id: str, model: str, keep: Any) -> None:
        self.req = req
        self.chat_req = chat_req
        self.num_prompt_tokens = chat.num_prompt_tokens
        self.resp_id = resp_id
        self.model = model
        self.keep = keep
        self.created_at = R.now_s()
        self.parser = ChatDeltaParser(chat.parses, chat.reasoning)
        self.state = ChoiceState(index=0)
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.started = False

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {R.dumps(data)}\n\n"

    def _lifecycle(self, kind: str, status: str) -> str:
        finish = self.state.finish_reason
        u = usage(self.num_prompt_tokens, [self.state], 1) if status != "in_progress" else None
        return self._event(kind, response=R.response_body(
            self.req, self.resp_id, self.created_at, self.model, list(self.items), status,
            finish, u))

    def _close(self) -> list[str]:
        """Finish the open item (text or call): its done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        self.items.append(item)
        item["status"] = "completed"
        out = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                out.append(self._event("response.output_text.done", text=part["text"],
                                       logprobs=[], **ids))
            else:
                out.append(self._event("response.reasoning_text.done", text=part["text"],
                                       **ids))
            out.append(self._event("response.content_part.done", part=part, **ids))
        else:
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=index, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.open = item
        added = {**item, "status": "in_progress"}
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        out.append(self._event("response.output_item.added", output_index=len(self.items),
                               item=added))
        if item["type"] in ("message", "reasoning"):
            part = R.output_text("") if item["type"] == "message" else R.reasoning_text("")
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.items), content_index=0,
                                   part=part))
        return out

    def chunks(self, idx: int, d: SeqDelta) -> list[Chunk]:
        out: list[Chunk] = []
        if not self.started:
            self.started = True
            out += [self._lifecycle("response.created", "in_progress"),
                    self._lifecycle("response.in_progress", "in_progress")]
        self.state.add(d)
        reasoning, content, entries, finish = self.parser.feed(d)
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open(R.reasoning_item(f"rs_{uuid.uuid4().hex}", "",
                                                   "in_progress"))
            assert self.open is not None
            self.open["content"][0]["text"] += reasoning
            out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                   output_index=len(self.items), content_index=0,
                                   delta=reasoning))
        if content:
            if self.open is None or self.open["type"] != "message":
                out += self._open(R.message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
            assert self.open is not None
            self.open["content"][0]["text"] += content
            out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                   output_index=len(self.items), content_index=0,
                                   delta=content, logprobs=[]))
        for entry in entries or ():
            fn = entry["function"]
            if "id" in entry:
                out += self._open(R.function_call_item(entry["id"], fn["name"], "",
                                                       "in_progress"))
            assert self.open is not None and self.open["type"] == "function_call"
            if fn.get("arguments"):
                self.open["arguments"] += fn["arguments"]
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=self.open["id"],
                                       output_index=len(self.items), delta=fn["arguments"]))
        if finish is not None:
            out += self._close()
        return out

    async def final(self) -> list[str]:
        out = self._close()
        status = "incomplete" if self.state.finish_reason == "length" else "completed"
        last = self._lifecycle(f"response.{status}", status)
        out.append(last)
        if self.req.store:
            body = R.response_body(self.req, self.resp_id, self.created_at, self.model,
                                   self.items, status, self.state.finish_reason,
                                   usage(self.num_prompt_tokens, [self.state], 1))
            await self.keep(self.resp_id, body,
                            R.history_of(self.chat_req, self.items, self.req.instructions))
        return out

    def error_event(self, err: OpenAIError) -> str:
        return self._event("error", code=err.code or err.type, message=err.message,
                           param=err.param)

    def done(self) -> str:
        return ""
