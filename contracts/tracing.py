"""OpenTelemetry tracing of one process: off by default, free when off.

Every tandem process (router, prefill, decode, colocated engine, store node) takes
``--otlp-traces-endpoint`` (vLLM's flag) and ``--otlp-traces-protocol``. Without an
endpoint, :func:`start_tracing` returns a :class:`Tracing` whose tracer is the API's
``NoOpTracer``: the OpenTelemetry SDK is never imported, no ``TracerProvider`` is
installed, no exporter thread runs, and callers skip span work on ``tracing.enabled``.

With one, the SDK's ``TracerProvider`` (``service.name`` naming the process's role:
``tandem-router``, ``tandem-prefill``, ``tandem-decode``, ``tandem-kvstore``) hands ended
spans to the SDK's ``BatchSpanProcessor``, which exports them over OTLP (HTTP/protobuf
or gRPC) on its own thread. The provider is this object's, never the API's global one:
two tracers in one process (tests) do not interfere. An endpoint that is down or slow
never reaches a request: a failed export and a span that finds the processor's queue full
are dropped and counted (``tandem:otlp_spans_dropped``: :meth:`Tracing.collect`). The
SDK's own environment variables (``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``,
``OTEL_EXPORTER_OTLP_TRACES_HEADERS``) keep their documented meaning.

Context travels as W3C TraceContext (``traceparent`` / ``tracestate``) through the
API's ``TraceContextTextMapPropagator``: HTTP headers into the router, gRPC metadata to
the engines, a dict field where one call carries many requests.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from tandem.contracts.tracing_export import DropCounter

#: ``--otlp-traces-protocol`` values (OTLP's names, as ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``).
PROTOCOLS = ("grpc", "http/protobuf")
#: The environment variable that sets the protocol when the flag is not given.
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TracingConfig:
    """Where a process exports its spans (flag names in parentheses).

    Attributes:
        otlp_traces_endpoint: OTLP collector URL (``--otlp-traces-endpoint``), ``None``:
            tracing off. gRPC: ``http://host:4317``; HTTP/protobuf: the full traces
            URL, ``http://host:4318/v1/traces``.
        otlp_traces_protocol: ``grpc`` or ``http/protobuf`` (``--otlp-traces-protocol``).
        service_name: the ``service.name`` resource attribute (``tandem-<role>``).

    Raises:
        ValueError: naming the flag, for an unknown protocol or an endpoint that is not
            an ``http``/``https`` URL with a host.
    """

    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "grpc"
    service_name: str = "tandem"

    def __post_init__(self) -> None:
        if self.otlp_traces_protocol not in PROTOCOLS:
            raise ValueError(
                f"--otlp-traces-protocol must be one of {', '.join(PROTOCOLS)}, "
                f"got {self.otlp_traces_protocol!r}"
            )
        if self.otlp_traces_endpoint is not None:
            url = urlparse(self.otlp_traces_endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(
                    "--otlp-traces-endpoint must be an http:// or https:// URL "
                    f"with a host, got {self.otlp_traces_endpoint!r}"
                )

    @property
    def enabled(self) -> bool:
        """Whether spans are exported at all."""
        return self.otlp_traces_endpoint is not None

    @classmethod
    def from_args(
        cls, ns: argparse.Namespace, environ: Mapping[str, str], service_name: str
    ) -> TracingConfig:
        """From the flags of :func:`add_tracing_flags` and the environment (read only here).

        The protocol: the flag, else ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else
        ``http/protobuf`` for an endpoint whose path ends in ``/v1/traces`` (OTLP/HTTP's
        traces path) and ``grpc`` (vLLM's default) for any other.

        Raises:
            ValueError: as the class.
        """
        endpoint = getattr(ns, "otlp_traces_endpoint", None) or None
        protocol = getattr(ns, "otlp_traces_protocol", None) or environ.get(PROTOCOL_ENV)
        if not protocol:
            path = urlparse(endpoint).path if endpoint else ""
            protocol = "http/protobuf" if path.rstrip("/").endswith("/v1/traces") else "grpc"
        return cls(
            otlp_traces_endpoint=endpoint, otlp_traces_protocol=protocol, service_name=service_name
        )


def engine_service_name(role: str) -> str:
    """``service.name`` of an engine of ``role`` (``prefill``, ``decode``, ``both``): the
    colocated engine serves ``DecodeService`` and is ``tandem-decode`` too."""
    return "tandem-prefill" if str(role) == "prefill" else "tandem-decode"


def add_tracing_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--otlp-traces-endpoint`` and ``--otlp-traces-protocol`` to ``parser``."""
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces over OTLP to this collector "
        "(vLLM's flag; gRPC: http://host:4317, HTTP: "
        "http://host:4318/v1/traces); default: tracing off",
    )
    parser.add_argument(
        "--otlp-traces-protocol",
        default=None,
        choices=PROTOCOLS,
        help="OTLP transport (default: $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, "
        "else http/protobuf for a URL ending in /v1/traces, else grpc)",
    )


class Tracing:
    """One process's tracer and propagation (see the module docstring).

    Build it with :func:`start_tracing`. ``enabled`` is False when tracing is off: the
    tracer is then a ``NoOpTracer`` and :meth:`extract` / :meth:`inject` return at once.
    Safe for use from any thread.
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        provider: TracerProvider | None = None,
        counter: DropCounter | None = None,
    ) -> None:
        self.tracer = tracer
        self.enabled = provider is not None
        self._provider = provider
        self._counter = counter

    @property
    def num_dropped_spans(self) -> int:
        """Spans dropped so far: failed exports and a full processor queue."""
        return self._counter.value if self._counter is not None else 0

    def extract(self, carrier: Mapping[str, str] | Iterable[tuple[str, Any]]) -> Context | None:
        """The remote parent in ``carrier`` (HTTP headers, gRPC metadata pairs or a dict
        of ``traceparent``/``tracestate``), or ``None`` when tracing is off. A carrier
        without a valid ``traceparent`` gives a context without a parent: spans started
        in it begin a new trace."""
        if not self.enabled:
            return None
        if not isinstance(carrier, Mapping):
            carrier = {k.lower(): v for k, v in carrier if isinstance(v, str)}
        return _PROPAGATOR.extract(carrier)

    def inject(self, span: trace.Span | None) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming ``span`` as the parent; empty when
        tracing is off or ``span`` is ``None``."""
        if not self.enabled or span is None:
            return {}
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def span(
        self,
        name: str,
        parent: Context | trace.Span | None,
        *,
        start_ns: int | None = None,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
    ) -> trace.Span:
        """Start a span (end it with ``span.end(end_time=...)``) under ``parent`` (a
        context from :meth:`extract`, or a span), starting at ``start_ns`` (Unix epoch
        ns, :func:`wall_ns`) or now. Off: the API's non-recording span."""
        ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
        return self.tracer.start_span(
            name, context=ctx, kind=kind, attributes=attributes, start_time=start_ns
        )

    def record(
        self,
        name: str,
        parent: Context | trace.Span | None,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A finished span from ``start_ns`` to ``end_ns`` (Unix epoch ns): a stage whose
        bounds were stamped anyway, recorded after the fact."""
        self.span(name, parent, start_ns=start_ns, attributes=attributes).end(
            end_time=max(end_ns, start_ns)
        )

    def collect(self) -> Iterator[Any]:
        """Prometheus collector protocol: ``tandem:otlp_spans_dropped`` (register the
        object itself: ``registry.register(tracing)``)."""
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily(
            "tandem:otlp_spans_dropped",
            "Spans not exported: the OTLP endpoint failed or the export queue was full.",
            value=self.num_dropped_spans,
        )

    def shutdown(self) -> None:
        """Export what is queued (within the SDK's shutdown deadline) and stop the
        exporter thread. Off: nothing."""
        if self._provider is not None:
            self._provider.shutdown()


#: The tracing of a process that exports nothing (tests, the offline API).
TRACING_OFF = Tracing(trace.NoOpTracer())


def start_tracing(config: TracingConfig) -> Tracing:
    """The process's :class:`Tracing`: :data:`TRACING_OFF` when ``config`` is off (the SDK
    is not imported), else the SDK's provider with a ``BatchSpanProcessor`` over the
    OTLP exporter of ``config.otlp_traces_protocol`` (:mod:`.tracing_export`)."""
    if config.otlp_traces_endpoint is None:
        return TRACING_OFF
    # Imported only when on: tracing off costs no SDK import, provider or thread.
    from tandem.contracts.tracing_export import start_provider

    provider, counter = start_provider(
        config.otlp_traces_endpoint, config.otlp_traces_protocol, config.service_name
    )
    return Tracing(provider.get_tracer("tandem"), provider, counter)


def wall_ns(monotonic_ns: int | None = None) -> int:
    """Unix epoch ns (OpenTelemetry's clock) of a ``time.monotonic_ns()`` stamp (the
    clock of every ``*_ns`` duration in tandem), or of now."""
    if monotonic_ns is None:
        return time.time_ns()
    return time.time_ns() - (time.monotonic_ns() - monotonic_ns)
