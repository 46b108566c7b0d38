"""Answering one generation request over HTTP: gathering a whole answer, or streaming it
as server-sent events, while watching the client and the router's drain.

A streamed response starts only once the first token exists: errors found before it
(engine rejects the prompt, no instance, overload) are plain HTTP errors with their status.
A failure after that is sent as the streamer's error event (OpenAI's ``data: {"error":
...}``, or each API's own), followed by the streamer's end marker (OpenAI's ``data:
[DONE]``). A client that leaves before its answer is complete cancels the generation;
that is logged at debug level.

Each front door (OpenAI completions and chat, Responses, Anthropic Messages) supplies a
``Streamer``: the events of its API for the pipeline's deltas.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tandem.services.router.drain import Drain, shutting_down_error
from tandem.services.router.errors import OpenAIError, to_openai_error
from tandem.services.router.responses import DONE, ChoiceState, sse
from tandem.services.router.sequence import SeqDelta

logger = logging.getLogger(__name__)

#: The status a request whose client left gets (nginx's "client closed request"); nobody
#: reads it, it is for access logs.
CLIENT_GONE = 499


class Streamer:
    """Builds the SSE events of one streamed request (one subclass per API).

    ``chunks`` is called once per pipeline delta, in order; ``final`` once after the last
    one (it may do I/O, e.g. store the answer); ``error_event`` renders a failure after the
    stream began, and ``done`` is the stream's last text.
    """

    def chunks(self, idx: int, d: SeqDelta) -> list[Chunk]:
        """The events of choice ``idx``'s delta ``d`` (may be none)."""
        raise NotImplementedError

    async def final(self) -> list[str]:
        """The events after the last delta (OpenAI: the usage chunk, when asked for)."""
        return []

    def error_event(self, err: OpenAIError) -> str:
        """The event of an error after the stream began (OpenAI's ``{"error": ...}``)."""
        return sse({"error": err.to_dict()})

    def done(self) -> str:
        """The stream's last text (OpenAI's ``data: [DONE]``)."""
        return DONE


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_done_or_gone(request: Request, task: asyncio.Future[Any],
                              drain: Drain) -> None:
    """Wait until ``task`` is done; a client that disconnects first cancels it (which
    unwinds the generation: its RPCs are cancelled), as does the end of a drain's grace
    period. Returns once ``task`` is done, its outcome not raised (read it from the task);
    a cancel of this coroutine cancels both."""
    watch = asyncio.create_task(until_disconnect(request))
    expired = asyncio.create_task(drain.expired.wait())
    try:
        await asyncio.wait({task, watch, expired}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        expired.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # (does not raise the task's outcome)


async def collect(request: Request, rid: str,
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
        await until_done_or_gone(request, work, drain)
    finally:
        await deltas.aclose()
    if work.cancelled() and drain.expired.is_set():
        raise shutting_down_error()
    if work.cancelled():
        logger.debug("request %s: the client disconnected before the answer; cancelled", rid)
        return None
    work.result()  # re-raise a generation error (OpenAIError -> its status)
    return states


async def stream(request: Request, rid: str,
                  deltas: AsyncGenerator[tuple[int, SeqDelta], None],
                  streamer: Streamer, drain: Drain) -> Response:
    """Start an SSE response once the first delta exists (earlier errors: plain HTTP).

    The wait for the first delta (prefill: can be minutes for a long prompt under load)
    watches the client: one that leaves meanwhile cancels the generation at once. The
    stream's chunks are made by one task per stream and handed over in a queue, so the end
    of a drain's grace period can end a stream between any two chunks (an error event, then
    ``[DONE]``), however long the next token takes.
    """
    first_task = asyncio.ensure_future(deltas.__anext__())
    await until_done_or_gone(request, first_task, drain)
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
        return Response(status_code=CLIENT_GONE)

    chunks: asyncio.Queue[Chunk | None] = asyncio.Queue()  # None: the end

    def put(items: Sequence[Chunk]) -> None:
        for chunk in items:
            chunks.put_nowait(chunk)

    async def produce() -> None:
        try:
            if first is not None:
                put(streamer.chunks(*first))
                async for idx, d in deltas:
                    put(streamer.chunks(idx, d))
            put(await streamer.final())
        except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
            put([streamer.error_event(to_openai_error(exc))])
        finally:
            await deltas.aclose()
            chunks.put_nowait(None)

    async def body() -> AsyncIterator[str]:
        producer = asyncio.create_task(produce())

        def end_now() -> None:
            producer.cancel()
            chunks.put_nowait(streamer.error_event(shutting_down_error()))
            chunks.put_nowait(None)

        unregister = drain.on_expire(end_now)
        try:
            item: Chunk | None | object = await chunks.get()
            while item is not None:
                text, item = _take_ready(item, chunks)  # type: ignore[arg-type]
                # NOTE: the server asks for the next chunk once this one is written.
                yield text
                if item is _TAKE:
                    item = await chunks.get()
        finally:
            unregister()
            if not producer.done():
                producer.cancel()
            await asyncio.wait({producer})
        yield streamer.done()

    headers = {"X-Request-Id": rid, "Cache-Control": "no-cache"}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)



#: An SSE chunk's text.
Chunk = str
#: ``_take_ready``'s "nothing taken yet": the caller waits for the queue's next item.
_TAKE = object()


def _take_ready(item: Chunk, queue: asyncio.Queue[Chunk | None]) -> tuple[str, None | object]:
    """``item`` and every chunk queued behind it, as one write: (text, what comes next:
    ``None`` for the end, or ``_TAKE``). A client slower than the engine catches up in one
    write."""
    parts = [item]
    while not queue.empty():
        got = queue.get_nowait()
        if got is None:
            return "".join(parts), None
        parts.append(got)
    return "".join(parts), _TAKE

