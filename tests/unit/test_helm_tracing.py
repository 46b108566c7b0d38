"""The chart's ``tracing`` values: one OTLP endpoint handed to every component
(``--otlp-traces-endpoint``, ``--otlp-traces-protocol``), none by default."""

from __future__ import annotations

import pytest

helm = pytest.importorskip("helm_python")

from helm_support import (  # noqa: E402  (after the importorskip)
    CHART,
    TANDEM_ROLES,
    flag_values,
    manifests,
    tandem_containers,
)


def test_tracing_endpoint_reaches_every_component() -> None:
    seen = {}
    for role, c in tandem_containers(manifests("tracing")):
        flags = flag_values(c)
        seen[role] = (flags.get("--otlp-traces-endpoint"), flags.get("--otlp-traces-protocol"))
    assert set(seen) == set(TANDEM_ROLES), seen
    assert set(seen.values()) == {("http://otel-collector.observability:4317", "grpc")}, seen


def test_tracing_is_off_by_default() -> None:
    for role, c in tandem_containers(manifests("default")):
        assert not any(a.startswith("--otlp-traces") for a in c.get("args", [])), (role, c)


def test_schema_rejects_an_endpoint_that_is_not_a_url() -> None:
    with (
        helm.Chart.load(CHART) as chart,
        pytest.raises(helm.HelmValuesError, match="otlpTracesEndpoint"),
    ):
        chart.render({"tracing": {"otlpTracesEndpoint": "collector:4317"}})
