"""``DecodeStream``, the server side: many decode requests over one bidirectional call.

The router opens one such call per decode instance and starts and cancels its requests
on it (``DecodeStreamRequest``). Each request runs as its own task through the
per-request logic (a function from a ``DecodeRequest`` to its ``DecodeResponse``
messages); their messages meet in one outbox, and everything in the
outbox when the writer comes back for more goes out as one ``DecodeStreamResponse``.
An engine step hands its outputs to every request's task in the engine's order before
the writer runs again, so one step's tokens travel as one message, in a stable order:
one gRPC message per step instead of one per request, on both ends.

Streams are numbered by the caller (``DecodeStreamRequest.stream``, never reused on a
call), so a cancelled stream's last messages cannot reach a later request with the same
id. A request's failure is an item with an ``error``
(:func:`services.common.errors.describe`, the status its request failed with); the
call stays up for the others. Ending the call (the router going away, or the
server's grace period over) cancels every stream still running on it, which aborts its
request in the engine and frees its blocks; a draining server ends the call itself once
no stream runs on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from tandem.engine.validation import RequestError
from tandem.services.common.errors import describe
from tandem.v1 import decode_pb2

#: The per-request logic: a ``DecodeRequest`` to the messages of its stream.
Responses = Callable[[decode_pb2.DecodeRequest], AsyncIterator[decode_pb2.DecodeResponse]]

#: Items per DecodeStreamResponse at most (each holding one stream's messages ready
#: together): a writer held back by flow control
#: with hundreds of streams behind it must not build one message past gRPC's size limit,
#: which would fail the call and every stream on it.
MAX_ITEMS_PER_MESSAGE = 512


def error_item(stream: int, exc: Exception) -> decode_pb2.DecodeStreamItem:
    """The item that ends ``stream`` with ``exc``'s status (``describe``)."""
    code, message, field = describe(exc)
    return decode_pb2.DecodeStreamItem(stream=stream, error=decode_pb2.DecodeStreamError(
        code=code.value[0], message=message, field=field or ""))


async def serve_decode_stream(requests: AsyncIterator[decode_pb2.DecodeStreamRequest],
                              responses: Responses, draining: asyncio.Event | None = None
                              ) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
    """Run the streams started on ``requests`` with ``responses``; yield their messages,
    those ready together as one ``DecodeStreamResponse`` (at most
    ``MAX_ITEMS_PER_MESSAGE`` items). Ends when the caller has closed its side and every
    stream it started is over, or, once ``draining`` is set, as soon as no stream runs
    (so a draining server's grace period does not wait for an idle call).

    A ``start`` with the number of a stream that runs gets an INVALID_ARGUMENT item
    naming ``stream``; a ``cancel`` of a stream that is not running is ignored (it may
    have just finished).
    """
    outbox: asyncio.Queue[decode_pb2.DecodeStreamItem | None] = asyncio.Queue()
    tasks: dict[int, asyncio.Task[None]] = {}

    async def run(stream: int, request: decode_pb2.DecodeRequest) -> None:
        try:
            async for resp in responses(request):
                outbox.put_nowait(decode_pb2.DecodeStreamItem(stream=stream, response=resp))
        except Exception as exc:  # noqa: BLE001 - sent to the caller as the item's error
            outbox.put_nowait(error_item(stream, exc))
        finally:
            if tasks.get(stream) is asyncio.current_task():
                del tasks[stream]

    async def until_idle() -> None:
        while tasks:
            await asyncio.wait(set(tasks.values()))

    async def read() -> None:
        try:
            async for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "start":
                    if msg.stream in tasks:
                        outbox.put_nowait(error_item(msg.stream, RequestError(
                            "stream", f"stream: {msg.stream} is running on this call")))
                        continue
                    tasks[msg.stream] = asyncio.create_task(run(msg.stream, msg.start))
                elif kind == "cancel" and msg.cancel:
                    task = tasks.pop(msg.stream, None)
                    if task is not None:
                        task.cancel()
            await until_idle()  # the caller closed its side: what it started finishes
        finally:
            outbox.put_nowait(None)  # the writer ends

    async def end_when_drained() -> None:
        assert draining is not None
        await draining.wait()
        await until_idle()
        outbox.put_nowait(None)

    helpers = [asyncio.create_task(read())]
    if draining is not None:
        helpers.append(asyncio.create_task(end_when_drained()))
    try:
        done = False
        while not done:
            item = await outbox.get()
            if item is None:
                break
            resp = decode_pb2.DecodeStreamResponse(items=[item])
            while not outbox.empty() and len(resp.items) < MAX_ITEMS_PER_MESSAGE:
                nxt = outbox.get_nowait()
                if nxt is None:
                    done = True
                    break
                resp.items.append(nxt)
            yield resp
    finally:
        running = [*helpers, *tasks.values()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
