"""Tenants at the router's doors: which tenant a request's API key belongs to, and
whether its limits admit the request (``--api-keys``; ``tenants``, ``rate_limit``).

Every generation request (``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``, ``/v1/messages``, the public gRPC ``Generate``) is counted against its
tenant once it is tokenized, before any engine sees it: one request, and its prompt tokens
plus the output tokens it may make (``max_tokens`` times ``n`` per prompt). When it ends
(finished, failed or abandoned) its tokens are corrected to its prompt tokens plus the
tokens actually generated. Over a limit: a 429 ``rate_limit_exceeded`` with
``Retry-After`` (Anthropic's ``rate_limit_error`` under ``/v1/messages``). When the
limiter's Redis cannot be reached the request is admitted (fail open) and the failure is
logged and counted: a store outage must not stop serving.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence

from prometheus_client import CollectorRegistry, Counter

from tandem.services.router.errors import OpenAIError
from tandem.services.router.rate_limit import RateLimiter, Ticket
from tandem.services.router.sequence import GenerationRequest, SeqDelta
from tandem.services.router.tenants import KeyTable, Tenant

logger = logging.getLogger(__name__)


class TenantMetrics:
    """The per-tenant series (``tenant`` label: the tenant's name), in ``registry``.

    ``tandem:router_rate_limited_total{tenant,limit}``: requests refused with a 429;
    ``tandem:router_tenant_requests_total{tenant}``: requests admitted;
    ``tandem:router_tenant_tokens_total{tenant}``: tokens charged to admitted requests
    once they ended (prompt + generated); ``tandem:router_rate_limit_errors_total``:
    admissions the limiter's store could not decide (admitted).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rate_limited = Counter("tandem:router_rate_limited",
                                    "Requests refused by their tenant's limits (429).",
                                    ["tenant", "limit"], registry=registry)
        self.requests = Counter("tandem:router_tenant_requests",
                                "Requests admitted by their tenant's limits.", ["tenant"],
                                registry=registry)
        self.tokens = Counter("tandem:router_tenant_tokens",
                              "Tokens (prompt + generated) of admitted requests, counted "
                              "when each ends.", ["tenant"], registry=registry)
        self.errors = Counter("tandem:router_rate_limit_errors",
                              "Admissions the rate limiter's store could not decide "
                              "(the request was admitted).", registry=registry)


def reserved_tokens(gens: Sequence[GenerationRequest]) -> int:
    """Tokens a request reserves at admission: per prompt, its tokens plus ``n`` times
    ``max_tokens`` (only its prompt when ``max_tokens`` is unset)."""
    total = 0
    for gen in gens:
        sp = gen.sampling_params
        total += len(gen.prompt_token_ids) + (sp.max_tokens or 0) * sp.n
    return total


def rate_limited(tenant: Tenant, limit: str, retry_after_s: int | None,
                 num_tokens: int) -> OpenAIError:
    """The 429 of a refused request (``retry_after_s`` ``None``: it exceeds the whole
    limit, so retrying cannot help and no ``Retry-After`` is given)."""
    per_minute = getattr(tenant, limit)
    if retry_after_s is None:
        message = (f"Request too large for tenant {tenant.name!r}: it needs {num_tokens} "
                   f"tokens, its limit is {per_minute} tokens per minute. Lower max_tokens "
                   "or the prompt.")
    else:
        unit = "requests" if limit == "requests_per_minute" else "tokens"
        message = (f"Rate limit reached for tenant {tenant.name!r}: {per_minute} {unit} per "
                   f"minute. Please try again in {retry_after_s}s.")
    return OpenAIError(message, status_code=429, code="rate_limit_exceeded",
                       retry_after_s=retry_after_s)


class Tenancy:
    """API keys, their tenants and the tenants' limits, for every door of one router.

    Args:
        keys: the ``--api-keys`` table.
        limiter: where the tenants' windows live (Redis or this process).
        metrics: the per-tenant series.
    """

    def __init__(self, keys: KeyTable, limiter: RateLimiter, metrics: TenantMetrics) -> None:
        self.keys = keys
        self.limiter = limiter
        self.metrics = metrics

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant of ``key``.

        Raises:
            OpenAIError: 401 ``invalid_api_key`` for a missing or unknown key.
        """
        tenant = self.keys.tenant_of(key)
        if tenant is None:
            raise OpenAIError("invalid or missing API key", status_code=401,
                              code="invalid_api_key")
        return tenant

    async def admit(self, tenant: Tenant, num_tokens: int) -> Ticket | None:
        """Count one request of ``num_tokens`` tokens against ``tenant``: its ticket,
        ``None`` when nothing was counted (no limits, or the store failed).

        Raises:
            OpenAIError: 429 over a limit (``rate_limited``).
        """
        if not tenant.is_limited:
            self.metrics.requests.labels(tenant.name).inc()
            return None
        try:
            decision = await self.limiter.admit(tenant, num_tokens)
        except Exception as exc:  # noqa: BLE001 - the store's client raises its own types
            logger.warning("rate limiter unavailable, admitting tenant %s's request: %s",
                           tenant.name, exc)
            self.metrics.errors.inc()
            self.metrics.requests.labels(tenant.name).inc()
            return None
        if decision.ticket is None:
            assert decision.limit is not None, "a refusal names its limit"
            self.metrics.rate_limited.labels(tenant.name, decision.limit).inc()
            raise rate_limited(tenant, decision.limit, decision.retry_after_s, num_tokens)
        self.metrics.requests.labels(tenant.name).inc()
        return decision.ticket

    async def settle(self, tenant: Tenant, ticket: Ticket | None, num_tokens: int) -> None:
        """Charge a request that ended with ``num_tokens`` tokens used (``ticket``:
        what ``admit`` returned). Never raises: a store failure is logged."""
        self.metrics.tokens.labels(tenant.name).inc(num_tokens)
        if ticket is None:
            return
        try:
            await self.limiter.settle(ticket, num_tokens)
        except Exception as exc:  # noqa: BLE001 - the store's client raises its own types
            logger.warning("rate limiter unavailable, tenant %s keeps %d reserved tokens "
                           "for a request that used %d: %s", tenant.name, ticket.num_tokens,
                           num_tokens, exc)

    async def generate(self, tenant: Tenant,
                       deltas: AsyncGenerator[tuple[int, SeqDelta], None],
                       gens: Sequence[GenerationRequest]
                       ) -> AsyncGenerator[tuple[int, SeqDelta], None]:
        """``deltas`` (the generation of ``gens``) once ``tenant``'s limits admit it,
        settled when it ends. Nothing of ``deltas`` runs before the admission.

        Raises:
            OpenAIError: 429 over a limit, on the first item; else whatever ``deltas``
                raises.
        """
        num_prompt_tokens = sum(len(g.prompt_token_ids) for g in gens)
        num_generated = 0
        try:
            ticket = await self.admit(tenant, reserved_tokens(gens))
        except BaseException:
            await deltas.aclose()
            raise
        try:
            async with contextlib.aclosing(deltas):
                async for item in deltas:
                    num_generated += len(item[1].token_ids)
                    yield item
        finally:
            await self.settle(tenant, ticket, num_prompt_tokens + num_generated)
