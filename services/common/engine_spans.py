"""The spans of one request inside an engine service (prefill, decode, colocated).

Built only when the process traces (``ServiceContext.tracing.enabled``): the servicers
call :func:`request_span` and get ``None`` otherwise, and every other function here takes
that ``None`` and returns at once, so the default path stamps nothing it did not stamp
before. Stages are recorded after the fact from the monotonic stamps the service takes
anyway (arrival, ``Request.first_scheduled_time``, the engine step's end, the
connector's ``LoadResult`` / ``SaveResult``), converted to the Unix epoch clock that
OpenTelemetry uses (``tracing.wall_ns``).

Span names (``tandem.<stage>``) and attributes follow OpenTelemetry's RPC and
GenAI conventions where one exists (``gen_ai.request.id``, ``gen_ai.usage.*``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace

from tandem.contracts.tracing import Tracing, wall_ns
from tandem.engine.kv_connector import LoadResult, SaveResult
from tandem.engine.request import Request


def request_span(
    tracing: Tracing,
    name: str,
    carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None,
    request: Request,
    arrival_ns: int,
) -> trace.Span | None:
    """The server span of one request (``name``: ``tandem.prefill`` / ``tandem.decode``),
    started at ``arrival_ns`` (monotonic) under the caller's ``traceparent`` in
    ``carrier`` (gRPC metadata pairs, or ``DecodeRequest.trace_context``), and
    ``request.trace_headers`` set to name it, for the KV store's spans; ``None`` when
    tracing is off."""
    if not tracing.enabled:
        return None
    parent = tracing.extract(dict(carrier or ()))
    span = tracing.span(
        name,
        parent,
        start_ns=wall_ns(arrival_ns),
        kind=trace.SpanKind.SERVER,
        attributes={
            "gen_ai.request.id": request.request_id,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
        },
    )
    request.trace_headers = tracing.inject(span)
    return span


def record_schedule(
    tracing: Tracing,
    span: trace.Span | None,
    request: Request,
    arrival_ns: int,
    first_output_ns: int,
    queue_name: str,
    compute_name: str,
) -> None:
    """``queue_name``: arrival -> first scheduled; ``compute_name``: first scheduled ->
    the step end of the request's first output (all monotonic ns)."""
    if span is None:
        return
    scheduled_ns = (
        arrival_ns
        if request.first_scheduled_time is None
        else int(request.first_scheduled_time * 1e9)
    )
    tracing.record(queue_name, span, wall_ns(arrival_ns), wall_ns(scheduled_ns))
    tracing.record(
        compute_name,
        span,
        wall_ns(scheduled_ns),
        wall_ns(first_output_ns),
        {"gen_ai.usage.cached_tokens": max(request.num_cached_tokens, 0)},
    )


def record_publish(
    tracing: Tracing, span: trace.Span | None, start_ns: int, result: SaveResult
) -> None:
    """``tandem.kv_publish``: ``start_ns`` (the first token, monotonic) -> the store
    holds the request's blocks (``result``)."""
    if span is None:
        return
    tracing.record(
        "tandem.kv_publish",
        span,
        wall_ns(start_ns),
        wall_ns(result.done_ns),
        {
            "tandem.kv.blocks": result.num_blocks,
            "tandem.kv.blocks_stored": result.num_stored,
            "tandem.kv.ok": result.ok,
            "tandem.kv.tier": "store",
        },
    )


def record_pull(
    tracing: Tracing, span: trace.Span | None, arrival_ns: int, load: LoadResult
) -> None:
    """``tandem.kv_pull``: arrival -> the request's remote blocks loaded (``load``), with
    its bytes, tokens and any wait for blocks still being published."""
    if span is None:
        return
    attrs: dict[str, Any] = {
        "tandem.kv.bytes": load.num_bytes,
        "tandem.kv.tokens": load.num_tokens,
        "tandem.kv.requested_tokens": load.num_requested_tokens,
        "tandem.kv.tier": "store",
    }
    if load.wait_outcome is not None:
        attrs["tandem.kv.wait_outcome"] = load.wait_outcome
        attrs["tandem.kv.wait_ns"] = load.wait_ns
    tracing.record("tandem.kv_pull", span, wall_ns(arrival_ns), wall_ns(load.done_ns), attrs)


def tokens_event(span: trace.Span | None, num_tokens: int, step_end_ns: int, sent_ns: int) -> None:
    """A ``tokens`` event on the stream's span: ``num_tokens`` handed to gRPC at
    ``sent_ns``, made by the engine step that ended at ``step_end_ns`` (monotonic): the
    per-token output latency the default path does not measure."""
    if span is None:
        return
    span.add_event(
        "tokens",
        {
            "tandem.num_tokens": num_tokens,
            "tandem.output_latency_ns": max(sent_ns - step_end_ns, 0),
        },
        timestamp=wall_ns(sent_ns),
    )


def end_span(
    span: trace.Span | None, finish_reason: str | None = None, num_output_tokens: int | None = None
) -> None:
    """End a request's span (its outcome as attributes)."""
    if span is None:
        return
    if finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
    if num_output_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
    span.end()
