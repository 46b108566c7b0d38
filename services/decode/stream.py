"""``DecodeStream``, the server side: many Decode requests over one bidirectional call.

The router opens one such call per decode instance and starts and cancels its requests
on it (``DecodeStreamRequest``). Each request runs as its own task through the same
per-request logic as ``Decode`` (a function from a ``DecodeRequest`` to its
``DecodeResponse`` messages); their messages meet in one outbox, and everything in the
outbox when the writer comes back for more goes out as one ``DecodeStreamResponse``.
An engine step hands its outputs to every request's task in the engine's order before
the writer runs again, so one step's tokens travel as one message, in a stable order:
one gRPC message per step instead of one per request, on both ends.

A request's failure is an item with an ``error`` (:func:`services.common.errors.describe`,
the status its ``Decode`` would have ended with); the call stays up for the others.
Ending the call (the router going away, or the server's grace period over) cancels every
request still running on it, which aborts them in the engine and frees their blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from tandem.engine.validation import RequestError
from tandem.services.common.errors import describe
from tandem.v1 import decode_pb2

#: The per-request logic: a ``DecodeRequest`` to the messages ``Decode`` would stream.
Responses = Callable[[decode_pb2.DecodeRequest], AsyncIterator[decode_pb2.DecodeResponse]]


def error_item(request_id: str, exc: Exception) -> decode_pb2.DecodeStreamItem:
    """The item that ends ``request_id`` with ``exc``'s status (``describe``)."""
    code, message, field = describe(exc)
    return decode_pb2.DecodeStreamItem(request_id=request_id, error=decode_pb2.DecodeStreamError(
        code=code.value[0], message=message, field=field or ""))


async def serve_decode_stream(requests: AsyncIterator[decode_pb2.DecodeStreamRequest],
                              responses: Responses
                              ) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
    """Run the requests started on ``requests`` with ``responses``; yield their messages,
    those ready together as one ``DecodeStreamResponse``. Ends when the caller has
    closed its side and every request it started is over.

    A ``start`` without a ``request_id``, or with the id of a request still running on
    this call, gets an INVALID_ARGUMENT item naming ``request_id``; a ``cancel`` of an
    id not running is ignored (the request may have just finished).
    """
    outbox: asyncio.Queue[decode_pb2.DecodeStreamItem | None] = asyncio.Queue()
    tasks: dict[str, asyncio.Task[None]] = {}

    async def run(request_id: str, request: decode_pb2.DecodeRequest) -> None:
        try:
            async for resp in responses(request):
                outbox.put_nowait(decode_pb2.DecodeStreamItem(request_id=request_id,
                                                              response=resp))
        except Exception as exc:  # noqa: BLE001 - sent to the caller as the item's error
            outbox.put_nowait(error_item(request_id, exc))
        finally:
            if tasks.get(request_id) is asyncio.current_task():
                del tasks[request_id]

    async def read() -> None:
        try:
            await read_all()
        finally:
            outbox.put_nowait(None)  # the writer ends; a failure is raised by ``await reader``

    async def read_all() -> None:
        async for msg in requests:
            kind = msg.WhichOneof("kind")
            if kind == "start":
                rid = msg.start.request_id
                if not rid or rid in tasks:
                    why = ("request_id: required in DecodeStream" if not rid else
                           f"request_id: {rid!r} is already running on this call")
                    outbox.put_nowait(error_item(rid, RequestError("request_id", why)))
                    continue
                tasks[rid] = asyncio.create_task(run(rid, msg.start))
            elif kind == "cancel":
                task = tasks.pop(msg.cancel, None)
                if task is not None:
                    task.cancel()
        # the caller closed its side: the requests it started still finish
        while tasks:
            await asyncio.wait(set(tasks.values()))

    reader = asyncio.create_task(read())
    try:
        done = False
        while not done:
            item = await outbox.get()
            if item is None:
                break
            resp = decode_pb2.DecodeStreamResponse(items=[item])
            while not outbox.empty():
                nxt = outbox.get_nowait()
                if nxt is None:
                    done = True
                    break
                resp.items.append(nxt)
            yield resp
        await reader  # its failure (the call broke) is this call's
    finally:
        reader.cancel()
        running = [reader, *tasks.values()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
