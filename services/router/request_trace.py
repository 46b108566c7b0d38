"""The spans of one request at the router, and the trace context it sends the engines.

One ``tandem.request`` server span per request (under the client's W3C ``traceparent``
when it sent one, else the root of a new trace) with ``tandem.router_queue`` (arrival ->
admitted) under it; per completion, ``tandem.routing`` (each routing-policy choice),
``tandem.prefill`` (the Prefill call: its ``traceparent`` goes in the call's gRPC
metadata) and ``tandem.decode_stream`` (a Decode stream: its ``traceparent`` goes in
``DecodeRequest.trace_context``, since one DecodeStream call carries many requests), with
the stream's per-token timing attribution (messages, tokens, detokenization time summed
per token: :class:`StreamTimes`) as its attributes, recorded only here.

Everything is built only when the router traces: :func:`start_request` returns ``None``
otherwise, every method of :class:`SeqTrace` is reached through an ``if trace is not
None``, and the default path computes none of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from tandem.contracts.tracing import Tracing, wall_ns


class RequestTrace:
    """The root span of one request (all its completions).

    Args:
        tracing: the router's tracing (on).
        parent: the client's context (``Tracing.extract`` of its headers or metadata).
        request_id: the request's id; arrival_ns: its arrival (monotonic ns).
    """

    def __init__(
        self,
        tracing: Tracing,
        parent: Context | None,
        request_id: str,
        arrival_ns: int,
        num_prompt_tokens: int,
    ) -> None:
        self.tracing = tracing
        self.arrival_ns = arrival_ns
        self.span = tracing.span(
            "tandem.request",
            parent,
            start_ns=wall_ns(arrival_ns),
            kind=trace.SpanKind.SERVER,
            attributes={
                "gen_ai.request.id": request_id,
                "gen_ai.usage.input_tokens": num_prompt_tokens,
            },
        )

    def admitted(self, now_ns: int) -> None:
        """``tandem.router_queue``: arrival -> admitted at ``now_ns`` (monotonic)."""
        self.tracing.record(
            "tandem.router_queue", self.span, wall_ns(self.arrival_ns), wall_ns(now_ns)
        )

    def seq(self, index: int) -> SeqTrace:
        """The spans of completion ``index``."""
        return SeqTrace(self.tracing, self.span, index)

    def end(self, error: BaseException | None) -> None:
        """End the request's span; an error marks it failed."""
        if error is not None:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        self.span.end()


class SeqTrace:
    """The spans of one completion under its request's span."""

    def __init__(self, tracing: Tracing, parent: trace.Span, index: int) -> None:
        self.tracing = tracing
        self.parent = parent
        self.index = index

    def routing(self, stage: str, start_ns: int, end_ns: int, address: str) -> None:
        """``tandem.routing``: the policy chose ``address`` for ``stage`` between
        ``start_ns`` and ``end_ns`` (monotonic)."""
        self.tracing.record(
            "tandem.routing",
            self.parent,
            wall_ns(start_ns),
            wall_ns(end_ns),
            {"tandem.stage": stage, "tandem.instance": address},
        )

    def decision(self, decision: str | None, reason: str | None) -> None:
        """The disaggregation decision (``timings.disagg_decision``) as attributes."""
        self.parent.set_attribute("tandem.disagg_decision", decision or "")
        self.parent.set_attribute("tandem.disagg_reason", reason or "")

    def call(self, name: str, address: str) -> trace.Span:
        """A client span for one call to an engine (end it with :func:`end_call`)."""
        return self.tracing.span(
            name,
            self.parent,
            kind=trace.SpanKind.CLIENT,
            attributes={"tandem.instance": address, "tandem.completion_index": self.index},
        )

    def headers(self, span: trace.Span) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span``, for the engine."""
        return self.tracing.inject(span)


def end_call(
    span: trace.Span,
    error: BaseException | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """End a call's span; ``error`` marks it failed."""
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
    span.end()


class StreamTimes:
    """Where a decode stream's tokens spend their time at the router, summed while it
    runs and set on its span when it ends (:meth:`attributes`).

    NOTE: sums, not an event per message: an event costs the router more CPU than the
    message's own handling, and a trace backend needs the per-stream figures.
    """

    __slots__ = ("num_messages", "num_tokens", "detokenize_ns", "max_detokenize_ns")

    def __init__(self) -> None:
        self.num_messages = 0
        self.num_tokens = 0
        self.detokenize_ns = 0
        self.max_detokenize_ns = 0

    def add(self, num_tokens: int, recv_ns: int, ready_ns: int) -> None:
        """A message of ``num_tokens`` received at ``recv_ns`` whose text delta was ready
        at ``ready_ns`` (monotonic ns): its detokenization and stop-string time, counted
        once per token it carries."""
        took = max(ready_ns - recv_ns, 0)
        self.num_messages += 1
        self.num_tokens += num_tokens
        self.detokenize_ns += took * num_tokens
        self.max_detokenize_ns = max(self.max_detokenize_ns, took)

    def attributes(self) -> dict[str, int]:
        """The span attributes (``tandem.stream.*``; ``detokenize_ns`` summed over the
        tokens: divided by ``tokens`` it is the mean per token)."""
        return {
            "tandem.stream.messages": self.num_messages,
            "tandem.stream.tokens": self.num_tokens,
            "tandem.stream.detokenize_ns": self.detokenize_ns,
            "tandem.stream.max_detokenize_ns": self.max_detokenize_ns,
        }
