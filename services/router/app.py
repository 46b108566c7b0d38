"""The router's FastAPI app: the generation routes of each API, health, metrics.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``openai_routes``),
``POST /v1/responses`` and ``GET /v1/responses/{id}`` (``responses_api``), ``POST
/v1/messages`` and ``POST /v1/messages/count_tokens`` (``messages_api``),
``POST /tokenize`` and ``POST /detokenize`` (``tokenize_api``, vLLM's bodies),
``GET /v1/models`` and ``GET /v1/models/{model}`` (``models_api``), ``GET /health`` (the
router is up; body counts the instances), ``GET /ready`` (200 only when some instance path
can serve), ``GET /metrics``; any other path is a 404 naming it. How a generation is
answered or streamed: ``streaming``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tandem.contracts.role import ROLES, Role
from tandem.services.router import (
    messages_api,
    models_api,
    openai_routes,
    openapi,
    responses_api,
    tokenize_api,
)
from tandem.services.router import protocol as P
from tandem.services.router.door import Door
from tandem.services.router.drain import Drain, shutting_down_error
from tandem.services.router.errors import OpenAIError, error_response, openai_error_handler
from tandem.services.router.frontend import Frontend
from tandem.services.router.messages_protocol import CountTokensRequest, MessagesRequest
from tandem.services.router.metrics import CONTENT_TYPE
from tandem.services.router.response_store import MemoryResponseStore, ResponseStore
from tandem.services.router.responses_protocol import ResponsesRequest
from tandem.services.router.streaming import CLIENT_GONE
from tandem.services.router.tenancy import Tenancy

logger = logging.getLogger(__name__)


#: The routes whose requests a drain waits for and ends (``drain.Drain``).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/messages"})


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
            response = error_response(shutting_down_error(), rid.decode() if rid else None,
                                      anthropic=scope["path"] == "/v1/messages")
            await response(scope, receive, send)
            return
        async with self.drain.request():
            await self.app(scope, receive, send)


def create_app(fe: Frontend, lifespan: Any = None, *,
               max_request_body_bytes: int, drain: Drain | None = None,
               response_store: ResponseStore | None = None,
               tenancy: Tenancy | None = None) -> FastAPI:
    """Build the FastAPI app around a ready ``Frontend``.

    Args:
        fe: tokenizer, pipeline and settings.
        lifespan: optional async context manager factory (starts/stops discovery).
        max_request_body_bytes: largest request body accepted (413 beyond).
        drain: the router's shutdown (``Drain.run`` on SIGTERM); a fresh one if ``None``.
        response_store: where ``/v1/responses`` keeps stored responses; ``None``: this
            process's memory (``MemoryResponseStore``, an hour's TTL).
        tenancy: the ``--api-keys`` tenants and their limits (``door.Door``), or ``None``.
    """
    drain = drain if drain is not None else Drain()
    app = FastAPI(title="tandem router", lifespan=lifespan)
    app.add_middleware(_DrainMiddleware, drain=drain)
    openapi.install(app, [P.CompletionRequest, P.ChatCompletionRequest,
                          ResponsesRequest, MessagesRequest, CountTokensRequest,
                          *tokenize_api.REQUEST_MODELS])
    # NOTE: one handler; the ``Exception`` entry only catches router bugs (-> 500, logged).
    for exc_type in (OpenAIError, ValidationError, RequestValidationError,
                     StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, openai_error_handler)
    app.add_exception_handler(ClientDisconnect, _client_gone_while_sending)
    door = Door(fe, drain, max_request_body_bytes, tenancy)

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
        # NOTE: off the event loop: the latency windows sort their samples per scrape.
        text = await asyncio.to_thread(fe.pipeline.metrics.render)
        return Response(text, media_type=CONTENT_TYPE)

    models_api.install(app, fe, door.check_auth)
    openai_routes.install(app, door)
    responses_api.install(app, door, response_store if response_store is not None
                          else MemoryResponseStore(ttl_s=3600))
    messages_api.install(app, door)
    tokenize_api.install(app, door)
    return app

async def _client_gone_while_sending(request: Request, exc: Exception) -> Response:
    """A client that left while sending its body: nothing to answer, not an error."""
    logger.debug("%s %s: the client disconnected while sending the body", request.method,
                 request.url.path)
    return Response(status_code=CLIENT_GONE)

