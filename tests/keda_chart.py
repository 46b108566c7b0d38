"""The chart's KEDA ScaledObjects, rendered through the real Helm engine (helm-python-sdk:
no helm binary, no cluster), and the metrics their Prometheus queries name.

Shared by the chart's tests (tests/unit/test_helm_keda.py) and the router's
(tests/integration/test_router_autoscaling.py), which checks every name on a real
router's ``/metrics``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "helm" / "tandem"

#: Values that turn the ScaledObjects on, with a router HPA and the ServiceMonitor the
#: queries rely on.
KEDA_VALUES: dict[str, Any] = {
    "keda": {"enabled": True, "serverAddress": "http://prometheus.monitoring.svc:9090"},
    "serviceMonitor": {"enabled": True},
    "router": {"autoscaling": {"enabled": True}},
}

_QUERY = re.compile(r"^(sum|max)\((tandem:[a-z0-9_]+)\{([^}]*)\}\)$")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')
#: Labels Prometheus adds to what it scrapes (target labels), absent from /metrics itself.
TARGET_LABELS = frozenset({"namespace", "service", "job", "pod", "instance", "endpoint"})


def render(values: dict[str, Any], namespace: str = "llm") -> list[dict[str, Any]]:
    """Every manifest the chart renders for ``values`` (release ``demo``).

    Raises:
        Exception: Helm's error (a ``fail`` in a template, a schema violation).
    """
    import helm_python as helm

    with helm.Chart.load(CHART) as loaded:
        files = loaded.render(values, name="demo", namespace=namespace, is_install=True)
    return [
        doc
        for path, text in sorted(files.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def scaled_objects(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ScaledObjects among ``docs`` by the component they scale."""
    return {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d
        for d in docs
        if d["kind"] == "ScaledObject"
    }


def query_metric(query: str) -> tuple[str, dict[str, str]]:
    """(metric name, label matchers other than Prometheus' target labels) of one of the
    chart's queries, ``sum|max(NAME{matchers})``.

    Raises:
        AssertionError: the query has another shape.
    """
    match = _QUERY.match(query)
    assert match, f"unexpected query shape: {query}"
    labels = dict(_MATCHER.findall(match.group(3)))
    return match.group(2), {k: v for k, v in labels.items() if k not in TARGET_LABELS}
