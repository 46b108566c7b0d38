"""``DecodeStream``, the router's side: every decode request of this router on one
instance over one bidirectional call.

One :class:`DecodeMux` per decode (or colocated) instance holds the call: requests start
and cancel with small messages on it, and each message from the instance carries every
request's tokens of an engine step (``services.decode.stream``). A reader task hands
each item to its request's :class:`MuxedDecode`, which the pipeline iterates as it would
a server-streaming call: ``async for msg in call``, ``call.cancel()``, ``call.done()``,
and failures raised as ``grpc.aio.AioRpcError`` with the stream's error code, details and
field (trailing metadata ``FIELD_METADATA_KEY``). So retries, migration and the 400/503
rules of the pipeline see one request's status, as from a call of its own.

Why: per streamed token, a call per request costs the router a gRPC message read
(completion-queue poll, a callback into the event loop, a read future) and the instance a
write; with 64 streams an engine step's tokens arrived as 64 messages in an order that
changed from step to step, and that order was most of the inter-token jitter the router
added (docs/benchmarks.md, "The router's own ceiling"). One message per step, in the
engine's order, costs one read and keeps each stream's place.

Streams are numbered per call and never reused, so a cancelled stream's last messages,
still on their way, are dropped rather than handed to a later request with the same id.
When the call breaks (the instance died, the channel failed) every request on it fails
with the call's status, as their own calls would have; the next request opens a new
call. A draining instance ends the call once no stream runs on it (its grace period then
ends early), and the router opens a new call for the next request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc

from tandem.services.common.errors import FIELD_METADATA_KEY
from tandem.v1 import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)

_Item: TypeAlias = decode_pb2.DecodeResponse | grpc.aio.AioRpcError


class MuxedDecode:
    """One request's stream over a :class:`DecodeMux` (the ``grpc.aio`` call surface the
    pipeline uses). Iterate it once; ``cancel()`` aborts the request."""

    def __init__(self, mux: DecodeMux, stream: int) -> None:
        self._mux = mux
        self._stream = stream
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._done = False

    def done(self) -> bool:
        """The request is over: finished, failed or cancelled."""
        return self._done

    def cancel(self) -> bool:
        """Abort the request on the instance (nothing when it is over already)."""
        if self._done:
            return False
        self._done = True
        self._mux.cancel(self._stream)
        return True

    def _put(self, item: _Item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[decode_pb2.DecodeResponse]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[decode_pb2.DecodeResponse]:
        while not self._done:
            item = await self._queue.get()
            if isinstance(item, grpc.aio.AioRpcError):
                self._done = True
                raise item
            if item.finish_reason:
                self._done = True
            yield item


class DecodeMux:
    """The one ``DecodeStream`` call to an instance; :meth:`start` a request on it.

    Args:
        address: the instance's address.
        stub: its DecodeService stub.
        on_closed: ``on_closed(mux, error)``, once, when the call is over (``error``: its
            status as a ``grpc.aio.AioRpcError``); the pool then forgets the mux.
    """

    def __init__(self, address: str, stub: decode_pb2_grpc.DecodeServiceStub,
                 on_closed: Callable[[DecodeMux, grpc.aio.AioRpcError], None]) -> None:
        self.address = address
        self._call = stub.DecodeStream()
        self._on_closed = on_closed
        self._handles: dict[int, MuxedDecode] = {}
        self._next_stream = 0
        self._outgoing: asyncio.Queue[decode_pb2.DecodeStreamRequest] = asyncio.Queue()
        self.closed = False
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write())

    def start(self, request: decode_pb2.DecodeRequest) -> MuxedDecode:
        """Start ``request`` on a new stream of the call and return the stream. The
        instance judges the request (a request id already in flight there is its
        INVALID_ARGUMENT, raised when the stream is read); a closed call's stream fails
        with UNAVAILABLE when read."""
        stream = self._next_stream
        self._next_stream += 1
        handle = MuxedDecode(self, stream)
        if self.closed:
            handle._put(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details=(
                f"the DecodeStream call to {self.address} is closed")))
            return handle
        self._handles[stream] = handle
        self._outgoing.put_nowait(decode_pb2.DecodeStreamRequest(stream=stream,
                                                                 start=request))
        return handle

    def cancel(self, stream: int) -> None:
        """Abort ``stream``'s request on the instance (a stream over already is ignored).
        Its messages still on their way are dropped: stream numbers are never reused."""
        if self._handles.pop(stream, None) is not None and not self.closed:
            self._outgoing.put_nowait(decode_pb2.DecodeStreamRequest(stream=stream,
                                                                     cancel=True))

    async def close(self) -> None:
        """End the call: the instance cancels every request still on it."""
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)

    async def _write(self) -> None:
        try:
            while True:
                await self._call.write(await self._outgoing.get())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader reports the call's end
            logger.debug("DecodeStream to %s: write failed: %r", self.address, exc)
            # a request whose start was not sent must not wait forever: end the call,
            # so the reader fails every request on it
            self._call.cancel()

    async def _read(self) -> None:
        error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details=(
            f"{self.address} ended the DecodeStream call"))
        try:
            async for resp in self._call:
                for item in resp.items:
                    self._dispatch(item)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED,
                                         details="the router closed the DecodeStream call")
            raise
        except Exception as exc:
            logger.exception("DecodeStream to %s failed", self.address)
            error = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, details=(
                f"DecodeStream to {self.address}: {type(exc).__name__}: {exc}"))
        finally:
            self.closed = True
            self._writer.cancel()
            handles, self._handles = self._handles, {}
            for handle in handles.values():
                handle._put(error)
            self._on_closed(self, error)

    def _dispatch(self, item: decode_pb2.DecodeStreamItem) -> None:
        stream = item.stream
        handle = self._handles.get(stream)
        if handle is None:
            return  # cancelled here while its last messages were on the way
        if item.HasField("error"):
            del self._handles[stream]
            err = item.error
            trailing = grpc.aio.Metadata()
            if err.field:
                trailing.add(FIELD_METADATA_KEY, err.field)
            handle._put(grpc.aio.AioRpcError(_STATUS.get(err.code, grpc.StatusCode.UNKNOWN),
                                             grpc.aio.Metadata(), trailing, err.message))
            return
        if item.response.finish_reason:
            del self._handles[stream]
        handle._put(item.response)


#: gRPC status codes by their number (DecodeStreamError.code).
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
