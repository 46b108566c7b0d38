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

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import trace

from tandem.contracts.tracing import Tracing, wall_ns
from tandem.engine.kv_connector import LoadResult, SaveResult
from tandem.engine.outputs import EngineCoreOutput
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


class EngineStreamTimes:
    """Where a decode stream's tokens spend their time in the engine service, summed while
    it runs and set on the request's span when it ends (:meth:`attributes`): the engine's
    decode time (first to last output's step end) and, per token, the step end -> its
    message handed to gRPC.

    NOTE: sums, not an event per message: an event per message costs more CPU than the
    message itself, and a trace backend needs the per-stream figures.
    """

    __slots__ = (
        "first_step_ns",
        "last_step_ns",
        "num_outputs",
        "output_latency_ns",
        "max_output_latency_ns",
    )

    def __init__(self) -> None:
        self.first_step_ns: int | None = None
        self.last_step_ns = 0
        self.num_outputs = 0
        self.output_latency_ns = 0
        self.max_output_latency_ns = 0

    def add(self, batch: Sequence[tuple[EngineCoreOutput, int]], sent_ns: int) -> None:
        """One message of ``batch`` (outputs with their step ends), handed to gRPC at
        ``sent_ns`` (monotonic ns)."""
        for out, step_end_ns in batch:
            took = max(sent_ns - step_end_ns, 0)
            self.output_latency_ns += took * len(out.new_token_ids)
            self.max_output_latency_ns = max(self.max_output_latency_ns, took)
        if self.first_step_ns is None:
            self.first_step_ns = batch[0][1]
        self.last_step_ns = batch[-1][1]
        self.num_outputs += len(batch)

    def attributes(self) -> dict[str, int]:
        """The span attributes (``tandem.stream.*``; ``output_latency_ns`` summed over the
        tokens)."""
        first = self.first_step_ns if self.first_step_ns is not None else self.last_step_ns
        return {
            "tandem.stream.engine_outputs": self.num_outputs,
            "tandem.stream.engine_decode_ns": self.last_step_ns - first,
            "tandem.stream.output_latency_ns": self.output_latency_ns,
            "tandem.stream.max_output_latency_ns": self.max_output_latency_ns,
        }


def end_span(
    span: trace.Span | None,
    finish_reason: str | None = None,
    num_output_tokens: int | None = None,
    times: EngineStreamTimes | None = None,
) -> None:
    """End a request's span (its outcome and the stream's ``times`` as attributes)."""
    if span is None:
        return
    if times is not None:
        span.set_attributes(times.attributes())
    if finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", (finish_reason,))
    if num_output_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", num_output_tokens)
    span.end()
