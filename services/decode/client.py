"""A blocking client of one decode request: its own ``DecodeStream`` call, one stream.

The router multiplexes its requests over one call per instance
(``services.router.decode_mux``); a script, a benchmark or a test that sends one request
at a time uses :class:`DecodeCall`, which reads like a server-streaming call: iterate it
for the request's ``DecodeResponse`` messages, ``cancel()`` it to abort the request. The
stream's error item is raised as :class:`DecodeStreamFailure`, a ``grpc.RpcError`` with
the code, details and field (trailing metadata ``tandem-field``) the instance reported;
failures of the call itself (deadline, instance gone) are gRPC's own ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from tandem.services.common.errors import FIELD_METADATA_KEY
from tandem.v1 import decode_pb2, decode_pb2_grpc

#: gRPC status codes by their number (``DecodeStreamError.code``).
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


class DecodeStreamFailure(grpc.RpcError):
    """A stream's error item (``DecodeStreamError``), as a ``grpc.RpcError``.

    Args:
        error: the item's error: ``code`` (a ``grpc.StatusCode`` number), ``message``,
            ``field`` (the request field at fault; empty when none).
    """

    def __init__(self, error: decode_pb2.DecodeStreamError) -> None:
        super().__init__(error.message)
        self._code = _STATUS.get(error.code, grpc.StatusCode.UNKNOWN)
        self._details = error.message
        self._field = error.field

    def code(self) -> grpc.StatusCode:
        """The stream's status code (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)."""
        return self._code

    def details(self) -> str:
        """The instance's message (a bad field is named in it)."""
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """``(("tandem-field", field),)`` when the error names a field, else empty."""
        return ((FIELD_METADATA_KEY, self._field),) if self._field else ()


class DecodeCall:
    """One ``DecodeRequest`` on a ``DecodeStream`` call of its own.

    The call starts at construction and the caller's side closes after the start
    message, so the instance ends the call when the request is over.

    Args:
        stub: a blocking ``DecodeServiceStub``.
        request: the request (the colocated, disaggregated or resumed form).
        timeout: the call's deadline in seconds (``None``: none); passing it aborts the
            request and raises DEADLINE_EXCEEDED from the iteration.
        metadata: the call's metadata.

    Raises (from iteration):
        DecodeStreamFailure: the instance failed the request (its error item).
        grpc.RpcError: the call itself failed (deadline, cancelled, unavailable).
    """

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeServiceStub,
        request: decode_pb2.DecodeRequest,
        timeout: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        start = decode_pb2.DecodeStreamRequest(stream=0, start=request)
        self._call = stub.DecodeStream(iter([start]), timeout=timeout, metadata=tuple(metadata))
        self._messages = self._read()

    def __iter__(self) -> Iterator[decode_pb2.DecodeResponse]:
        return self

    def __next__(self) -> decode_pb2.DecodeResponse:
        return next(self._messages)

    def cancel(self) -> bool:
        """Abort the request on the instance (its KV blocks are freed at once)."""
        return bool(self._call.cancel())

    def _read(self) -> Iterator[decode_pb2.DecodeResponse]:
        for resp in self._call:
            for item in resp.items:
                if item.HasField("error"):
                    raise DecodeStreamFailure(item.error)
                yield item.response
