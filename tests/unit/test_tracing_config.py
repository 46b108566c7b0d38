"""``contracts/tracing.py``: the flags read into ``TracingConfig`` (protocol from the flag,
the environment or the URL; bad values named), tracing off as the no-op API only, and a
span's context carried through W3C ``traceparent``."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tandem.contracts.tracing import (
    TRACING_OFF,
    TracingConfig,
    add_tracing_flags,
    start_tracing,
)


def _config(argv: list[str], environ: dict[str, str] | None = None) -> TracingConfig:
    p = argparse.ArgumentParser()
    add_tracing_flags(p)
    return TracingConfig.from_args(p.parse_args(argv), environ or {}, "tandem-router")


def test_protocol_comes_from_the_flag_then_the_environment_then_the_url() -> None:
    assert _config([]) == TracingConfig(None, "grpc", "tandem-router")
    assert not _config([]).enabled
    http = "http://c:4318/v1/traces"
    assert _config(["--otlp-traces-endpoint", http]).otlp_traces_protocol == "http/protobuf"
    assert _config(["--otlp-traces-endpoint", "http://c:4317"]).otlp_traces_protocol == "grpc"
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    assert _config(["--otlp-traces-endpoint", http], env).otlp_traces_protocol == "grpc"
    flag = ["--otlp-traces-endpoint", "http://c:4317", "--otlp-traces-protocol", "http/protobuf"]
    assert _config(flag, env).otlp_traces_protocol == "http/protobuf"


@pytest.mark.parametrize(
    ("endpoint", "protocol", "field"),
    [
        ("collector:4317", "grpc", "--otlp-traces-endpoint"),
        ("ftp://c:4317", "grpc", "--otlp-traces-endpoint"),
        ("http://c:4317", "thrift", "--otlp-traces-protocol"),
    ],
)
def test_bad_values_are_named(endpoint: str, protocol: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TracingConfig(endpoint, protocol)


def test_off_is_the_no_op_api_without_the_sdk() -> None:
    """In a fresh interpreter: tracing off imports no SDK and starts no thread."""
    code = (
        "import sys, threading\n"
        "from tandem.contracts.tracing import TracingConfig, start_tracing\n"
        "t = start_tracing(TracingConfig())\n"
        "s = t.span('x', t.extract({'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}))\n"
        "s.end()\n"
        "assert not t.enabled and t.inject(s) == {} and not s.is_recording()\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')]\n"
        "assert [th.name for th in threading.enumerate()] == ['MainThread']\n"
    )
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=60)
    assert start_tracing(TracingConfig()) is TRACING_OFF


def test_a_span_context_travels_as_traceparent() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracing = start_tracing(TracingConfig("http://127.0.0.1:9/v1/traces", "http/protobuf"))
    try:
        parent = tracing.extract([("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")])
        span = tracing.span("s", parent)
        headers = tracing.inject(span)  # never ended: nothing is exported
        trace_id, span_id = headers["traceparent"].split("-")[1:3]
        assert (trace_id, span_id) == ("ab" * 16, format(span.get_span_context().span_id, "016x"))
    finally:
        tracing.shutdown()
