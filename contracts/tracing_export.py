"""The OpenTelemetry SDK side of :mod:`.tracing`: provider, batch processor, OTLP exporter
and the counting of dropped spans.

Imported only when a process exports traces (``--otlp-traces-endpoint``): with tracing
off the SDK is never loaded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from urllib.parse import urlparse

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

#: Spans the batch processor holds before it drops new ones (the SDK's default).
MAX_QUEUE_SIZE = 2048


class DropCounter:
    """A thread-safe count of dropped spans (``value``) and of spans waiting in the batch
    processor's queue."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0
        self._queued = 0

    def add_dropped(self, n: int) -> None:
        """Count ``n`` spans dropped."""
        with self._lock:
            self.value += n

    def enqueue(self) -> bool:
        """Count one more span waiting; False (and the span counted dropped) when the
        queue is full, where the batch processor would drop it without a word."""
        with self._lock:
            if self._queued >= MAX_QUEUE_SIZE:
                self.value += 1
                return False
            self._queued += 1
            return True

    def dequeue(self, n: int) -> None:
        """``n`` spans left the queue for an export."""
        with self._lock:
            self._queued = max(self._queued - n, 0)


class _QueueGuard(SpanProcessor):
    """In front of the batch processor: a span that would find its queue full is
    counted dropped here instead of vanishing there."""

    def __init__(self, inner: SpanProcessor, counter: DropCounter) -> None:
        self._inner = inner
        self._counter = counter

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context=parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if self._counter.enqueue():
            self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class _CountingExporter(SpanExporter):
    """The OTLP exporter; the spans of an export that failed (endpoint down, timeout,
    rejected) are counted dropped."""

    def __init__(self, inner: SpanExporter, counter: DropCounter) -> None:
        self._inner = inner
        self._counter = counter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._counter.dequeue(len(spans))
        try:
            result = self._inner.export(spans)
        except Exception:  # NOTE: counted, not raised: it would end the export thread
            result = SpanExportResult.FAILURE
        if result != SpanExportResult.SUCCESS:
            self._counter.add_dropped(len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP span exporter for ``protocol`` (``grpc`` or ``http/protobuf``) sending to
    ``endpoint`` (an ``http://`` gRPC endpoint is plaintext, ``https://`` TLS)."""
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPExporter,
        )

        return HTTPExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GRPCExporter,
    )

    return GRPCExporter(endpoint=endpoint, insecure=urlparse(endpoint).scheme == "http")


def start_provider(
    endpoint: str, protocol: str, service_name: str
) -> tuple[TracerProvider, DropCounter]:
    """A tracer provider (``service.name`` = ``service_name``) whose ended spans go
    through the SDK's ``BatchSpanProcessor`` to the OTLP exporter, and the counter of
    the spans it drops. Not installed as the API's global provider."""
    counter = DropCounter()
    exporter = _CountingExporter(otlp_exporter(endpoint, protocol), counter)
    batch = BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUE_SIZE)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(_QueueGuard(batch, counter))
    return provider, counter
