"""The router's FastAPI app: OpenAI routes, health, metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as server-sent
events or not), ``GET /v1/models`` and ``GET /v1/models/{model}`` (``models_api``),
``GET /health`` (the router is up; body counts the instances), ``GET /ready`` (200 only
when some instance path can serve), ``GET /metrics``; any other path is a 404 naming it.

A streamed response starts only once the first token exists: errors found before it
(engine rejects the prompt, no instance, overload) are plain HTTP errors with their status;
the first chat chunk carries the role together with the first token, and a chat choice's
finish reason comes in a chunk of its own with an empty delta, as OpenAI's. A failure after
that is sent as ``data: {"error": ...}`` followed by ``data: [DONE]``. A client that leaves
before its answer is complete cancels the generation; that is logged at debug level.

Bodies are read by ``body.read_json_body`` (size limit, UTF-8, valid Unicode) and
validated by the strict pydantic models of ``protocol``; ``/openapi.json`` documents them
(``openapi``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tandem.contracts.role import ROLES, Role
from tandem.services.router import models_api, openapi
from tandem.services.router import protocol as P
from tandem.services.router.body import read_json_body
from tandem.services.router.drain import Drain, shutting_down_error
from tandem.services.router.errors import (
    OpenAIError,
    error_response,
    openai_error_handler,
    to_openai_error,
)
from tandem.services.router.frontend import Frontend
from tandem.services.router.metrics import CONTENT_TYPE
from tandem.services.router.responses import (
    DONE,
    ChoiceState,
    SSETemplate,
    chat_logprobs,
    completion_logprobs,
    merged,
    sse,
    usage,
)
from tandem.services.router.sequence import GenerationRequest, SeqDelta
from tandem.services.router.tools import ToolCallParser, ToolChoice, finish_reason_with_calls

logger = logging.getLogger(__name__)

_Req = TypeVar("_Req", P.CompletionRequest, P.ChatCompletionRequest)
_T = TypeVar("_T")
#: The status a request whose client left gets (nginx's "client closed request"); nobody
#: reads it, it is for access logs.
_CLIENT_GONE = 499


#: The routes whose requests a drain waits for and ends (``drain.Drain``).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _DrainMiddleware:
    """Counts each generation request from its first byte to its last (a stream's body
    included) in the ``Drain``, and refuses new ones with a 503 once it drains."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            rid = dict(scope.get("headers") or ()).get(b"x-request-id")
            response = error_response(shutting_down_error(), rid.decode() if rid else None)
            await response(scope, receive, send)
            return
        async with self.drain.request():
            await self.app(scope, receive, send)


def create_app(fe: Frontend, lifespan: Any = None, *,
               max_request_body_bytes: int, drain: Drain | None = None) -> FastAPI:
    """Build the FastAPI app around a ready ``Frontend``.

    Args:
        fe: tokenizer, pipeline and settings.
        lifespan: optional async context manager factory (starts/stops discovery).
        max_request_body_bytes: largest request body accepted (413 beyond).
        drain: the router's shutdown (``Drain.run`` on SIGTERM); a fresh one if ``None``.
    """
    max_body = max_request_body_bytes
    drain = drain if drain is not None else Drain()
    app = FastAPI(title="tandem router", lifespan=lifespan)
    app.add_middleware(_DrainMiddleware, drain=drain)
    openapi.install(app, [P.CompletionRequest, P.ChatCompletionRequest])
    # NOTE: one handler; the ``Exception`` entry only catches router bugs (-> 500, logged).
    for exc_type in (OpenAIError, ValidationError, RequestValidationError,
                     StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, openai_error_handler)
    app.add_exception_handler(ClientDisconnect, _client_gone_while_sending)

    def check_auth(request: Request) -> None:
        if fe.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {fe.api_key}":
            raise OpenAIError("invalid or missing API key", status_code=401,
                              code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = {role.value: len(fe.pipeline.discovery.instances(role)) for role in ROLES}
        return JSONResponse({"status": "ok", "instances": counts})

    @app.get("/ready", responses={503: {"model": P.ErrorResponse,
                                        "description": "no live engine instance yet"}})
    async def ready() -> JSONResponse:
        if drain.draining:
            raise shutting_down_error()
        d = fe.pipeline.discovery
        if d.has_live(Role.PREFILL) and d.has_live(Role.DECODE):
            return JSONResponse({"status": "ready", "mode": "disagg"})
        if d.has_live(Role.BOTH):
            return JSONResponse({"status": "ready", "mode": "colocated"})
        if fe.pipeline.can_prefill_locally():
            # the decode instances prefill prompts themselves until a prefill one is up
            return JSONResponse({"status": "ready", "mode": "disagg", "prefill": "local"})
        raise OpenAIError("no live engine instance yet", status_code=503, retry_after_s=1)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        fe.pipeline.metrics.set_instances(fe.pipeline.discovery.all_instances())
        return Response(fe.pipeline.metrics.render(), media_type=CONTENT_TYPE)

    models_api.install(app, fe, check_auth)

    async def accept(request: Request, model: type[_Req]) -> tuple[str, int, _Req]:
        """Authenticate, name and parse one generation request: ``(request id, arrival
        time in ns, the parsed body)``. Raises ``OpenAIError`` (401, 400, 404)."""
        check_auth(request)
        rid = fe.new_request_id(request.headers.get("x-request-id"))
        arrival_ns = time.monotonic_ns()
        req = model.model_validate(await read_json_body(request, max_body))
        fe.check_model(req.model)
        return rid, arrival_ns, req

    def reply(body: P.CompletionResponse | P.ChatCompletionResponse, rid: str,
              num_prompt_tokens: int, states: list[ChoiceState], n: int) -> JSONResponse:
        """The non-streamed answer ``body`` with the usage and timings of ``states``
        (``n`` choices per prompt)."""
        body.usage = usage(num_prompt_tokens, states, n)
        body.timings = _timings(states)
        return JSONResponse(body.model_dump(mode="json"), headers={"X-Request-Id": rid})

    @app.post("/v1/completions", response_model=P.CompletionResponse,
              openapi_extra=openapi.request_body(P.CompletionRequest),
              responses={**openapi.GENERATION_ERRORS, **openapi.streamed(
                  "the completion; with `stream: true` server-sent events of "
                  "CompletionChunk objects, then `data: [DONE]`")})
    async def completions(request: Request) -> Response:
        rid, arrival_ns, req = await accept(request, P.CompletionRequest)
        prompts = fe.tokenize_prompts(req.prompt)
        constraint = await _off_loop(req, req.constraint)
        gens = []
        for p, ids in enumerate(prompts):
            sp = req.to_sampling_params(num_prompt_tokens=len(ids),
                                        max_model_len=fe.max_model_len, constraint=constraint,
                                        defaults=fe.sampling_defaults)
            fe.check_sampling_params(sp)
            gens.append(GenerationRequest(rid if len(prompts) == 1 else f"{rid}-p{p}", ids, sp,
                                          req.priority, arrival_ns,
                                          param_of_field=constraint.param_of_field))
        if isinstance(req.prompt, str):
            echo_texts = [req.prompt]
        elif isinstance(req.prompt[0], str):
            echo_texts = list(req.prompt)
        else:  # (only the count matters without echo: no detokenizing for nothing)
            echo_texts = [fe.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        n = gens[0].sampling_params.n
        resp_id = f"cmpl-{rid}"
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            return await _stream(request, rid, merged(fe, gens), _CompletionStreamer(
                fe, req, resp_id, n, echo_texts, num_prompt_tokens), drain)
        states = await _collect(request, rid, merged(fe, gens), len(prompts) * n, drain)
        if states is None:
            return Response(status_code=_CLIENT_GONE)
        choices = []
        for i, st in enumerate(states):
            prefix = echo_texts[i // n] if req.echo else ""
            lps = completion_logprobs(fe, st.logprobs, len(prefix)) if req.logprobs is not None \
                else None
            choices.append(P.CompletionChoice(index=i, text=prefix + st.text, logprobs=lps,
                                              finish_reason=st.finish_reason,
                                              stop_reason=st.stop_reason))
        body = P.CompletionResponse(id=resp_id, model=req.model or fe.model_name,
                                    choices=choices)
        return reply(body, rid, num_prompt_tokens, states, n)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse,
              openapi_extra=openapi.request_body(P.ChatCompletionRequest),
              responses={**openapi.GENERATION_ERRORS, **openapi.streamed(
                  "the chat completion; with `stream: true` server-sent events of "
                  "ChatCompletionChunk objects, then `data: [DONE]`")})
    async def chat_completions(request: Request) -> Response:
        rid, arrival_ns, req = await accept(request, P.ChatCompletionRequest)
        tool_choice = await _off_loop(req, req.tool_choice_spec)
        messages = [m.to_template() for m in req.messages]
        tools = ([t.to_template() for t in tool_choice.tools]
                 if tool_choice is not None and tool_choice.render_tools else None)
        ids = fe.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     kwargs=req.chat_template_kwargs, tools=tools)
        constraint = await _off_loop(
            req, lambda: req.constraint(tool_choice.constraint() if tool_choice else None))
        sp = req.to_sampling_params(num_prompt_tokens=len(ids), max_model_len=fe.max_model_len,
                                    constraint=constraint, defaults=fe.sampling_defaults)
        fe.check_sampling_params(sp)
        param_of_field = dict(constraint.param_of_field)
        if tool_choice is not None and tool_choice.mode == "named":
            index = [t.name for t in tool_choice.tools].index(str(tool_choice.name))
            param_of_field = {f: f"tools[{index}].function.parameters" for f in param_of_field}
        elif tool_choice is not None and tool_choice.mode == "required":
            param_of_field = {f: "tools" for f in param_of_field}
        gen = GenerationRequest(rid, ids, sp, req.priority, arrival_ns,
                                param_of_field=param_of_field)
        resp_id = f"chatcmpl-{rid}"
        parses = tool_choice if tool_choice is not None and tool_choice.parses_calls else None
        if req.stream:
            return await _stream(request, rid, merged(fe, [gen]),
                                 _ChatStreamer(fe, req, resp_id, len(ids), parses), drain)
        states = await _collect(request, rid, merged(fe, [gen]), sp.n, drain)
        if states is None:
            return Response(status_code=_CLIENT_GONE)
        choices = []
        for st in states:
            message, finish = _chat_message(st.text, st.finish_reason, parses)
            choices.append(P.ChatChoice(
                index=st.index, message=message,
                logprobs=chat_logprobs(fe, st.logprobs) if req.logprobs else None,
                finish_reason=finish, stop_reason=st.stop_reason))
        body = P.ChatCompletionResponse(id=resp_id, model=req.model or fe.model_name,
                                        choices=choices)
        return reply(body, rid, len(ids), states, sp.n)

    return app


async def _off_loop(req: P._SamplingRequest, check: Callable[[], _T]) -> _T:
    """Run ``check`` (building a request's constraint or tools: JSON-schema checks in pure
    Python, linear in the schema's size) on a worker thread when the request has such
    fields, so that one large schema does not stall every other request."""
    if not req.has_constraint_fields():
        return check()
    return await asyncio.to_thread(check)


def _chat_message(text: str, finish_reason: str | None, tool_choice: ToolChoice | None
                  ) -> tuple[P.ChatResponseMessage, str | None]:
    """A whole answer's message and finish reason: with tools, its calls parsed out."""
    if tool_choice is None:
        return P.ChatResponseMessage(content=text), finish_reason
    parser = ToolCallParser(tool_choice)
    first, rest = parser.feed(text), parser.finish()
    # The same rule as the streamed answer (_ChatStreamer._tool_delta): no leading
    # whitespace, and no trailing whitespace beside calls.
    content = (first.content + rest.content).lstrip()
    calls = parser.calls
    if calls:
        content = content.rstrip()
    message = P.ChatResponseMessage(content=content or None,
                                    tool_calls=[c.to_openai() for c in calls] or None)
    return message, finish_reason_with_calls(finish_reason, bool(calls))


async def _client_gone_while_sending(request: Request, exc: Exception) -> Response:
    """A client that left while sending its body: nothing to answer, not an error."""
    logger.debug("%s %s: the client disconnected while sending the body", request.method,
                 request.url.path)
    return Response(status_code=_CLIENT_GONE)


def _timings(states: list[ChoiceState]) -> dict[str, Any] | None:
    t = states[0].timings if states else None
    return t.to_dict() if t is not None else None


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_done_or_gone(request: Request, task: asyncio.Future[Any],
                              drain: Drain) -> None:
    """Wait until ``task`` is done; a client that disconnects first cancels it (which
    unwinds the generation: its RPCs are cancelled), as does the end of a drain's grace
    period. Returns once ``task`` is done, its outcome not raised (read it from the task);
    a cancel of this coroutine cancels both."""
    watch = asyncio.create_task(_until_disconnect(request))
    expired = asyncio.create_task(drain.expired.wait())
    try:
        await asyncio.wait({task, watch, expired}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        expired.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # (does not raise the task's outcome)


async def _collect(request: Request, rid: str,
                   deltas: AsyncGenerator[tuple[int, SeqDelta], None],
                   num_choices: int, drain: Drain) -> list[ChoiceState] | None:
    """Gather all deltas; ``None`` when the client disconnected first (which cancels the
    generation: an outcome for nobody, so no error). Raises: the generation's error, or a
    503 when the router's drain ended the request."""
    states = [ChoiceState(index=i) for i in range(num_choices)]

    async def consume() -> None:
        async for idx, d in deltas:
            states[idx].add(d)

    work = asyncio.create_task(consume())
    try:
        await _until_done_or_gone(request, work, drain)
    finally:
        await deltas.aclose()
    if work.cancelled() and drain.expired.is_set():
        raise shutting_down_error()
    if work.cancelled():
        logger.debug("request %s: the client disconnected before the answer; cancelled", rid)
        return None
    work.result()  # re-raise a generation error (OpenAIError -> its status)
    return states


async def _stream(request: Request, rid: str,
                  deltas: AsyncGenerator[tuple[int, SeqDelta], None],
                  streamer: _Streamer, drain: Drain) -> Response:
    """Start an SSE response once the first delta exists (earlier errors: plain HTTP).

    The wait for the first delta (prefill: can be minutes for a long prompt under load)
    watches the client: one that leaves meanwhile cancels the generation at once. The
    stream's chunks are made by one task per stream and handed over in a queue, so the end
    of a drain's grace period can end a stream between any two chunks (an error event, then
    ``[DONE]``), however long the next token takes.
    """
    first_task = asyncio.ensure_future(deltas.__anext__())
    await _until_done_or_gone(request, first_task, drain)
    try:
        first = None if first_task.cancelled() else first_task.result()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await deltas.aclose()
        raise
    if first_task.cancelled():
        await deltas.aclose()
        if drain.expired.is_set():
            raise shutting_down_error()
        logger.debug("request %s: the client disconnected before the first token; "
                     "cancelled", rid)
        return Response(status_code=_CLIENT_GONE)

    chunks: asyncio.Queue[_Queued | None] = asyncio.Queue()  # None: the end

    def put(d: SeqDelta | None, items: Sequence[_Chunk]) -> None:
        for chunk in items:
            chunks.put_nowait((chunk, d))

    async def produce() -> None:
        try:
            if first is not None:
                put(first[1], streamer.chunks(*first))
                async for idx, d in deltas:
                    put(d, streamer.chunks(idx, d))
            put(None, streamer.final())
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
            put(None, [sse({"error": to_openai_error(exc).to_dict()})])
        finally:
            await deltas.aclose()
            chunks.put_nowait(None)

    async def body() -> AsyncIterator[str]:
        producer = asyncio.create_task(produce())

        def end_now() -> None:
            producer.cancel()
            chunks.put_nowait((sse({"error": shutting_down_error().to_dict()}), None))
            chunks.put_nowait(None)

        unregister = drain.on_expire(end_now)
        try:
            item: _Queued | None | object = await chunks.get()
            while item is not None:
                text, shown, item = _take_ready(item, chunks)  # type: ignore[arg-type]
                # NOTE: the server asks for the next chunk once this one is written.
                yield text
                now = time.monotonic_ns()
                for d in shown:
                    assert d.seq_timings is not None
                    d.seq_timings.add_sse(now - d.ready_ns, len(d.token_ids))
                if item is _TAKE:
                    item = await chunks.get()
        finally:
            unregister()
            if not producer.done():
                producer.cancel()
            await asyncio.wait({producer})
        yield DONE

    headers = {"X-Request-Id": rid, "Cache-Control": "no-cache"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


#: An SSE chunk, or a function that makes it when it is written (a choice's last chunk:
#: its ``timings`` then include the SSE writes of the chunks before it).
_Chunk = str | Callable[[], str]


#: A chunk queued for the SSE writer and the delta it shows (``None``: no delta's).
_Queued = tuple[_Chunk, SeqDelta | None]
#: ``_take_ready``'s "nothing taken yet": the caller waits for the queue's next item.
_TAKE = object()


def _take_ready(item: _Queued, queue: asyncio.Queue[_Queued | None]
                ) -> tuple[str, list[SeqDelta], _Queued | None | object]:
    """``item`` and every chunk queued behind it, as one write: (text, the Decode
    deltas it shows, what comes next: an item already taken, ``None`` for the end, or
    ``_TAKE``). A client slower than the engine catches up in one write. A choice's last
    chunk (a function: its timings count the SSE writes before it) starts a new write
    unless it comes first."""
    parts: list[str] = []
    shown: list[SeqDelta] = []
    nxt: _Queued | None | object = _TAKE
    while True:
        chunk, d = item
        if not isinstance(chunk, str):
            if parts:
                nxt = item
                break
            chunk = chunk()
        parts.append(chunk)
        if d is not None and d.seq_timings is not None:
            shown.append(d)
        if queue.empty():
            break
        got = queue.get_nowait()
        if got is None:
            nxt = None
            break
        item = got
    return "".join(parts), shown, nxt


class _Streamer:
    """Builds the SSE chunks of one streamed request."""

    def __init__(self, fe: Frontend, req: P._SamplingRequest, resp_id: str, num_choices: int,
                 num_prompt_tokens: int, n: int) -> None:
        self.fe = fe
        self.req = req
        self.resp_id = resp_id
        self.created = int(time.time())
        self.model = req.model or fe.model_name
        self.states = [ChoiceState(index=i) for i in range(num_choices)]
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n  # choices per prompt
        opts = req.stream_options
        self._continuous_usage = bool(opts is not None and opts.include_usage
                                      and opts.continuous_usage_stats)
        self._templates: dict[int, SSETemplate | None] = {}

    def chunks(self, idx: int, d: SeqDelta) -> list[_Chunk]:
        raise NotImplementedError

    def _text_chunk(self, idx: int, text: str) -> str | None:
        """The SSE text of a chunk of choice ``idx`` that carries only ``text``, from
        its template (``SSETemplate``, made once per choice from ``_plain_chunk``), or
        ``None`` where the chunk needs more (running usage)."""
        if self._continuous_usage:
            return None
        if idx not in self._templates:
            self._templates[idx] = SSETemplate.of(sse(self._plain_chunk(idx,
                                                                         SSETemplate.MARK)))
        tpl = self._templates[idx]
        return tpl.render(text) if tpl is not None else None

    def _plain_chunk(self, idx: int, text: str) -> P.ChatCompletionChunk | P.CompletionChunk:
        """Choice ``idx``'s chunk with ``text`` and nothing else (not the first)."""
        raise NotImplementedError

    def _finish(self, chunk: P.ChatCompletionChunk | P.CompletionChunk, d: SeqDelta,
                last: bool = True) -> _Chunk:
        """The chunk's SSE text, with running usage (``continuous_usage_stats``); a
        choice's ``last`` chunk of its final delta gets its timings when it is written."""
        if self._continuous_usage:
            chunk.usage = usage(self.num_prompt_tokens, self.states, self.n)
        timings = d.timings if d.finish_reason is not None and last else None
        if timings is None:
            return sse(chunk)

        def with_timings() -> str:
            chunk.timings = timings.to_dict()
            return sse(chunk)

        return with_timings

    def final(self) -> list[str]:
        if not self.req.include_usage:
            return []
        u = usage(self.num_prompt_tokens, self.states, self.n)
        return [sse(self._usage_chunk(u))]

    def _usage_chunk(self, u: P.UsageInfo) -> P.BaseModel:
        raise NotImplementedError


class _ChatStreamer(_Streamer):
    """Chat chunks; with tools, each choice's text goes through a ``ToolCallParser`` and
    calls are sent as ``delta.tool_calls`` entries (``index``, then ``id``, ``type`` and
    ``function.name`` on a call's first entry, ``function.arguments`` in pieces), the
    shape the ``openai`` client's stream helpers assemble."""

    req: P.ChatCompletionRequest

    def __init__(self, fe: Frontend, req: P.ChatCompletionRequest, resp_id: str,
                 num_prompt_tokens: int, tool_choice: ToolChoice | None = None) -> None:
        super().__init__(fe, req, resp_id, req.n, num_prompt_tokens, req.n)
        self.parsers = ([ToolCallParser(tool_choice) for _ in range(req.n)]
                        if tool_choice is not None else None)
        self._num_calls_sent = [0] * req.n
        self._held_space = [""] * req.n
        self._content_started = [False] * req.n

    def _tool_delta(self, idx: int, d: SeqDelta) -> tuple[str | None, list[dict] | None,
                                                           str | None]:
        """(content, tool_calls entries, finish_reason) of one delta with tools."""
        assert self.parsers is not None
        parser = self.parsers[idx]
        named_before = parser.named_call is not None
        parsed = parser.feed(d.text)
        tail = parser.finish() if d.finish_reason is not None else None
        content = parsed.content + (tail.content if tail else "")
        calls = parsed.calls + (tail.calls if tail else [])
        entries: list[dict] = []
        if parsed.arguments:
            call = parser.named_call
            assert call is not None
            if named_before:
                entries.append({"index": 0, "function": {"arguments": parsed.arguments}})
            else:
                first = call.to_openai(0)
                first["function"]["arguments"] = parsed.arguments
                entries.append(first)
                self._num_calls_sent[idx] = 1
        for call in calls:
            entries.append(call.to_openai(self._num_calls_sent[idx]))
            self._num_calls_sent[idx] += 1
        # NOTE: trailing whitespace is held until text follows it, so the blank lines
        # around <tool_call> blocks do not end the content of an answer with calls, and
        # whitespace before the first text is dropped: the rule of _chat_message.
        content = self._held_space[idx] + content
        body = content.rstrip()
        self._held_space[idx], content = content[len(body):], body
        if d.finish_reason is not None and not parser.calls:
            content += self._held_space[idx]
        if not self._content_started[idx]:
            content = content.lstrip()
            self._content_started[idx] = bool(content)
        finish = finish_reason_with_calls(d.finish_reason, bool(parser.calls))
        return content or None, entries or None, finish

    def chunks(self, idx: int, d: SeqDelta) -> list[_Chunk]:
        st = self.states[idx]
        st.add(d)
        first = not st.sent_role
        content: str | None = d.text
        tool_calls = None
        finish = d.finish_reason
        if self.parsers is not None:
            content, tool_calls, finish = self._tool_delta(idx, d)
        lps = chat_logprobs(self.fe, d.logprobs) if self.req.logprobs and d.logprobs else None
        out: list[_Chunk] = []
        if content and not (first or tool_calls or lps):
            text = self._text_chunk(idx, content)
            if text is not None:
                out.append(text)
                content = None
        if content or tool_calls or first or lps:
            st.sent_role = True
            out.append(self._finish(self._chunk(P.ChatStreamChoice(
                index=idx, delta=P.DeltaMessage(role="assistant" if first else None,
                                                content=content, tool_calls=tool_calls),
                logprobs=lps)), d, last=finish is None))
        if finish is not None:
            # NOTE: OpenAI sends the finish reason in a chunk of its own, with an empty
            # delta: the openai SDK's stream helpers fire the `.done` event of a choice's
            # last tool call only on a chunk after the one that carries that call.
            out.append(self._finish(self._chunk(P.ChatStreamChoice(
                index=idx, delta=P.DeltaMessage(), finish_reason=finish,
                stop_reason=d.stop_reason)), d))
        return out

    def _chunk(self, choice: P.ChatStreamChoice) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                     choices=[choice])

    def _usage_chunk(self, u: P.UsageInfo) -> P.BaseModel:
        return P.ChatCompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                     choices=[], usage=u)

    def _plain_chunk(self, idx: int, text: str) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=self.resp_id, created=self.created, model=self.model,
            choices=[P.ChatStreamChoice(index=idx, delta=P.DeltaMessage(content=text))])


class _CompletionStreamer(_Streamer):
    req: P.CompletionRequest

    def __init__(self, fe: Frontend, req: P.CompletionRequest, resp_id: str, n: int,
                 echo_texts: list[str], num_prompt_tokens: int) -> None:
        super().__init__(fe, req, resp_id, n * len(echo_texts), num_prompt_tokens, n)
        self.echo_texts = echo_texts

    def chunks(self, idx: int, d: SeqDelta) -> list[_Chunk]:
        st = self.states[idx]
        first = not st.sent_role
        st.sent_role = True
        st.add(d)
        text = d.text
        if first and self.req.echo:
            text = self.echo_texts[idx // self.n] + text
        lps = None
        if self.req.logprobs is not None and d.logprobs:
            lps = completion_logprobs(self.fe, d.logprobs, st.text_offset)
            st.text_offset += sum(len(t) for t in lps.tokens)
        if not (text or d.finish_reason or lps):
            return []
        if not (lps or d.finish_reason):
            plain = self._text_chunk(idx, text)
            if plain is not None:
                return [plain]
        chunk = P.CompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                  choices=[P.CompletionChoice(
                                      index=idx, text=text, logprobs=lps,
                                      finish_reason=d.finish_reason,
                                      stop_reason=d.stop_reason)])
        return [self._finish(chunk, d)]

    def _usage_chunk(self, u: P.UsageInfo) -> P.BaseModel:
        return P.CompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                 choices=[], usage=u)

    def _plain_chunk(self, idx: int, text: str) -> P.CompletionChunk:
        return P.CompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                 choices=[P.CompletionChoice(index=idx, text=text)])
