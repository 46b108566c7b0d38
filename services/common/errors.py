"""The one place where exceptions of the engine services become gRPC status codes.

Servicers raise plain Python exceptions; :class:`ErrorMappingInterceptor` wraps
every RPC handler of the server and maps them (STYLE.md example 8):

=================================  ===================
exception                          gRPC status
=================================  ===================
``KVCapacityError``                RESOURCE_EXHAUSTED (the prompt never fits this
                                   instance's KV cache; another's may be larger)
``GrammarCompilerBusyError``       RESOURCE_EXHAUSTED (too many grammar compiles queued)
``ValueError``                     INVALID_ARGUMENT (the message names the field)
``UnknownRequestError``            NOT_FOUND
``CapacityError``                  RESOURCE_EXHAUSTED
``ShuttingDownError``              UNAVAILABLE
``EngineDeadError``                UNAVAILABLE (a worker process died: the service exits;
                                   the router retries or migrates the request)
``asyncio.CancelledError``         re-raised: the client went away; the servicer's
                                   request stream aborts the request and frees its
                                   blocks (see ``engine_loop.RequestStream``)
anything else                      INTERNAL (logged with its traceback)
=================================  ===================

A ``RequestError`` (a ``ValueError`` naming the request field at fault) also sends that
field as the trailing metadata entry :data:`FIELD_METADATA_KEY`, so a caller (the router)
can report it as the OpenAI error's ``param`` without parsing the message.
Handlers that carry several requests in one call (``DecodeStream``) report each
request's failure themselves, with :func:`describe`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from tandem.engine.errors import EngineDeadError
from tandem.engine.validation import GrammarCompilerBusyError, KVCapacityError, RequestError

logger = logging.getLogger(__name__)

#: Trailing-metadata key of the request field an INVALID_ARGUMENT names.
FIELD_METADATA_KEY = "tandem-field"


class UnknownRequestError(LookupError):
    """A request id the engine does not know."""


class CapacityError(RuntimeError):
    """The instance cannot take the request (queue full, or the prompt can never fit)."""


class ShuttingDownError(RuntimeError):
    """The instance is draining and takes no new requests."""


# NOTE: first match wins: KVCapacityError is a ValueError (the engine's own callers see
# a bad request), but for a service it is "not here", not "never".
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (KVCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (GrammarCompilerBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception raised by a servicer (INTERNAL if unmapped)."""
    for exc_type, code in _CODES:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def describe(exc: Exception) -> tuple[grpc.StatusCode, str, str | None]:
    """``(status code, message, the request field at fault or None)`` of an exception a
    servicer raised: what its RPC ends with. An unmapped exception (INTERNAL) is logged
    with its traceback here."""
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.exception("internal error in RPC handler", exc_info=exc)
        message = f"internal error: {type(exc).__name__}: {exc}"
    else:
        message = str(exc) or type(exc).__name__
    return code, message, exc.field if isinstance(exc, RequestError) else None


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message, field = describe(exc)
    trailing = ((FIELD_METADATA_KEY, field),) if field is not None else ()
    # context.abort raises grpc.aio.AbortError, which grpc turns into the status.
    await context.abort(code, message, trailing_metadata=trailing)


def _wrap_unary(
    behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc)

    return handler


def _wrap_stream(
    behavior: Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            await _abort(context, exc)

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wrap unary-unary and unary-stream handlers so exceptions map to status codes.

    Other handler kinds (health, reflection streams) pass through untouched.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if handler.unary_unary is not None and asyncio.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(
            handler.unary_stream
        ):
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

