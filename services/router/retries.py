"""Retries of calls to instances: which instance to try next, a failed call's
bookkeeping, and the engine's gRPC errors in the client's words (``Pipeline``'s base).

* ``Retries._attempts`` yields at most ``max_attempts`` instances of a stage, each
  chosen by the routing policy among those not tried yet.
* A failed call benches its instance (``Discovery.mark_failed``; not for a full one,
  RESOURCE_EXHAUSTED) and counts a retry.
* The engine's verdict on a bad request (``CALLER_ERROR_CODES``) is a 400 naming the
  client's field; no instance left is a 503 (``unavailable_error``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc

from tandem.contracts.role import Role
from tandem.services.common.errors import FIELD_METADATA_KEY
from tandem.services.router.client import CALLER_ERROR_CODES
from tandem.services.router.discovery import Discovery, InstanceInfo
from tandem.services.router.errors import OpenAIError
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.request_trace import SeqTrace
from tandem.services.router.routing import RouteContext, Router

logger = logging.getLogger(__name__)


class Retries:
    """The instances a stage tries in turn, and what a failed call does to them.

    Not constructed on its own: ``Pipeline`` sets every attribute declared here.
    """

    discovery: Discovery
    router: Router
    metrics: RouterMetrics
    max_attempts: int


    async def choose(self, cands: list[InstanceInfo], ctx: RouteContext,
                     trace: SeqTrace | None = None) -> InstanceInfo:
        """The routing policy's choice among ``cands`` (a ``tandem.routing`` span when
        ``trace`` is given)."""
        if trace is None:
            return await self.router.choose(cands, ctx)
        start_ns = time.monotonic_ns()
        info = await self.router.choose(cands, ctx)
        trace.routing(str(ctx.stage), start_ns, time.monotonic_ns(), info.address)
        return info

    async def _attempts(self, stage: Role, ctx: RouteContext,
                        first: InstanceInfo | None = None,
                        tried: set[str] | None = None, trace: SeqTrace | None = None
                        ) -> AsyncIterator[InstanceInfo]:
        """The instances to try in turn: at most ``max_attempts``, ``first`` (when given
        and still a candidate) then each chosen by the routing policy among the ``stage``
        instances not in ``tried`` (``Discovery.instances``: benched ones only when
        nothing else is left); ends early when none is left. Each one yielded is added to
        ``tried`` (a fresh set when not given). Holds nothing: a caller may stop
        iterating at any point."""
        tried = set() if tried is None else tried
        for _ in range(self.max_attempts):
            cands = self.discovery.instances(stage, exclude=tried)
            if not cands:
                return
            if first is not None and any(c.address == first.address for c in cands):
                info = next(c for c in cands if c.address == first.address)
            else:
                info = await self.choose(cands, ctx, trace)
            first = None
            tried.add(info.address)
            yield info

    def _failed(self, info: InstanceInfo, stage: Role, exc: grpc.aio.AioRpcError) -> None:
        logger.warning("%s call to %s failed (%s): %s", stage, info.address, exc.code().name,
                       exc.details())
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.discovery.mark_failed(info.address)
        self.metrics.retries.labels(model_name=self.metrics.model_name, stage=stage).inc()


#: Prefill failures a decode instance's own prefill may stand in for: the instance is
#: gone or restarting (UNAVAILABLE) or full (RESOURCE_EXHAUSTED). Not INTERNAL and the
#: like: a request that broke prefill engines must not go on to break decode ones.
PREFILL_FALLBACK_CODES = frozenset({grpc.StatusCode.UNAVAILABLE,
                                     grpc.StatusCode.RESOURCE_EXHAUSTED})

def raise_if_caller_error(exc: grpc.aio.AioRpcError, param_of_field: Mapping[str, str]
                           ) -> None:
    """A 400 for the engine's verdict on a bad request: ``param`` is the field the engine
    names (trailing metadata ``FIELD_METADATA_KEY``), in the client's API's words."""
    if exc.code() not in CALLER_ERROR_CODES:
        return
    message, param = _in_clients_words(exc, param_of_field)
    raise OpenAIError(message or "invalid request", status_code=400, param=param) from exc


def _in_clients_words(exc: grpc.aio.AioRpcError, param_of_field: Mapping[str, str]
                      ) -> tuple[str, str | None]:
    """The engine's message and the field it names (``FIELD_METADATA_KEY``), both in the
    client's API's words: ``(message, param)``."""
    field = None
    for key, value in exc.trailing_metadata() or ():
        if key == FIELD_METADATA_KEY and isinstance(value, str):
            field = value
    message = exc.details() or ""
    param = None
    if field is not None:
        param = param_of_field.get(field, field)
        if param != field and message.startswith(f"{field}:"):
            message = param + message[len(field):]
    return message, param


def unavailable_error(stage: Role, last: grpc.aio.AioRpcError | None,
                 param_of_field: Mapping[str, str]) -> OpenAIError:
    if last is not None and last.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Every instance was busy with this request's kind of work (a full queue, a
        # saturated grammar compiler): their reason, in the client's words.
        message, param = _in_clients_words(last, param_of_field)
        if param is not None:
            return OpenAIError(message, status_code=503, retry_after_s=1, param=param)
    why = f": {last.code().name} {last.details()}" if last is not None else ""
    role = "colocated" if stage == Role.BOTH else str(stage)
    return OpenAIError(f"no {role} instance could serve the request{why}", status_code=503,
                       retry_after_s=1)
