"""What every generation route of the HTTP API shares: the API key check (and the tenant it
names, whose limits admit the generation: ``tenancy``), the request id, the body's size
limit and parsing, the served model check, and the router's drain."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from tandem.services.router.body import read_json_body
from tandem.services.router.drain import Drain
from tandem.services.router.errors import OpenAIError
from tandem.services.router.frontend import Frontend
from tandem.services.router.responses import merged
from tandem.services.router.sequence import GenerationRequest, SeqDelta
from tandem.services.router.tenancy import Tenancy
from tandem.services.router.tenants import Tenant, key_of

_Req = TypeVar("_Req", bound=BaseModel)


@dataclass(frozen=True)
class Door:
    """The router's state a route needs, and the checks every generation route runs.

    Attributes:
        fe: tokenizer, pipeline and settings.
        drain: the router's shutdown (``Drain``).
        max_body_bytes: largest request body accepted (413 beyond).
        tenancy: the ``--api-keys`` tenants and their limits, or ``None`` (the single
            ``--api-key``, ``fe.api_key``, or no key).
    """

    fe: Frontend
    drain: Drain
    max_body_bytes: int
    tenancy: Tenancy | None = None

    def check_auth(self, request: Request) -> Tenant | None:
        """The router's one API key check: ``Authorization: Bearer KEY`` (OpenAI's
        clients) or ``x-api-key: KEY`` (Anthropic's) when the router has a key. With
        ``--api-keys``, the key's tenant, also kept in ``request.state.tenant`` for
        :meth:`generate`; else ``None``.

        Raises:
            OpenAIError: 401 ``invalid_api_key`` when neither header holds a key.
        """
        if self.tenancy is not None:
            tenant = self.tenancy.authenticate(key_of(request.headers))
            request.state.tenant = tenant
            return tenant
        key = self.fe.api_key
        if key is None:
            return None
        if (request.headers.get("authorization", "") != f"Bearer {key}"
                and request.headers.get("x-api-key") != key):
            raise OpenAIError("invalid or missing API key", status_code=401,
                              code="invalid_api_key")
        return None

    async def accept(self, request: Request, model: type[_Req]) -> tuple[str, int, _Req]:
        """Authenticate, name and parse one generation request: ``(request id, arrival
        time in ns, the parsed body)``; the body's ``model`` must be served here.

        Raises:
            OpenAIError: 401 (API key), 400 (body), 413 (size), 404 (``model``).
        """
        self.check_auth(request)
        rid = self.fe.new_request_id(request.headers.get("x-request-id"))
        arrival_ns = time.monotonic_ns()
        req = model.model_validate(await read_json_body(request, self.max_body_bytes))
        self.fe.check_model(getattr(req, "model", None))
        return rid, arrival_ns, req

    def generate(self, request: Request, gens: Sequence[GenerationRequest]
                 ) -> AsyncGenerator[tuple[int, SeqDelta], None]:
        """The deltas of ``gens`` (``responses.merged``), admitted first by the limits of
        the tenant :meth:`check_auth` found for ``request`` (with ``--api-keys``).

        Raises:
            OpenAIError: on the first item: 429 over the tenant's limits
                (``Tenancy.generate``); else the generation's errors.
        """
        tracing = self.fe.pipeline.tracing
        if tracing.enabled:
            parent = tracing.extract(request.headers)
            for g in gens:
                g.trace_parent = parent
        deltas = merged(self.fe, gens)
        tenant = getattr(request.state, "tenant", None)
        if self.tenancy is None or tenant is None:
            return deltas
        return self.tenancy.generate(tenant, deltas, gens)


def renamed(err: OpenAIError, rename: Callable[[str], str]) -> OpenAIError:
    """``err`` with its ``param`` (and the message's leading field name) in another API's
    words: a translated request's chat field names become the client's own."""
    if err.param is None:
        return err
    new = rename(err.param)
    if new == err.param:
        return err
    message = err.message.replace(err.param, new, 1)
    return OpenAIError(message, status_code=err.status_code, param=new, code=err.code,
                       retry_after_s=err.retry_after_s)
