"""The chart's opt-in KEDA ScaledObjects for prefill and decode.

Rendered through the real Helm engine and validated against the part of KEDA's
ScaledObject CRD schema the chart uses (keda_scaledobject.schema.json, written from
KEDA's documented spec: no network at test time). The chart's own HPA keeps working
without KEDA and is never rendered beside a ScaledObject for the same Deployment; a
scaled-down engine drains within its pod's grace period.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("helm_python")
jsonschema = pytest.importorskip("jsonschema")

from helm_support import (  # noqa: E402  (after the importorskips)
    ENGINE_ROLES,
    by_kind,
    containers,
    flag_values,
    manifests,
    merge,
    workload_of,
)
from keda_chart import KEDA_VALUES, query_metric, render, scaled_objects  # noqa: E402

SCHEMA = json.loads((Path(__file__).with_name("keda_scaledobject.schema.json")).read_text())


def _validator() -> Any:
    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


def _values(**overrides: Any) -> dict[str, Any]:
    values = copy.deepcopy(KEDA_VALUES)
    merge(values, overrides)
    return values


def _errors(obj: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(obj)
    ]


def test_no_scaled_object_by_default() -> None:
    assert by_kind(manifests("default"), "ScaledObject") == {}
    assert by_kind(manifests("production"), "ScaledObject") == {}


@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_scaled_objects_validate_against_keda_schema(role: str) -> None:
    docs = manifests("keda")
    obj = scaled_objects(list(docs))[role]
    assert _errors(obj) == []
    spec = obj["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    assert target["name"] == workload_of(docs, role)["metadata"]["name"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert {t["type"] for t in spec["triggers"]} == {"prometheus"}
    assert all(
        t["metadata"]["serverAddress"] == "http://prometheus.monitoring.svc:9090"
        for t in spec["triggers"]
    )
    # KEDA's HPA sets the replicas: the Deployment leaves them out, as under the chart's HPA.
    assert "replicas" not in workload_of(docs, role)["spec"]


def test_schema_rejects_what_keda_rejects() -> None:
    """The schema can fail: a trigger without a threshold, a typo'd field, a bad type."""
    good = scaled_objects(list(manifests("keda")))["decode"]
    no_threshold = copy.deepcopy(good)
    del no_threshold["spec"]["triggers"][0]["metadata"]["threshold"]
    typo = copy.deepcopy(good)
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    bad_type = copy.deepcopy(good)
    bad_type["spec"]["triggers"][0]["metricType"] = "Utilization"
    for broken in (no_threshold, typo, bad_type):
        assert _errors(broken), broken["spec"]


def test_queries_read_the_router_signals() -> None:
    """Each role scales on the router's series for that role, selected by the router
    Service's labels (what the ServiceMonitor scrapes)."""
    objs = scaled_objects(render(KEDA_VALUES))
    names: dict[str, dict[str, dict[str, str]]] = {}
    for role, obj in objs.items():
        for t in obj["spec"]["triggers"]:
            query = t["metadata"]["query"]
            assert 'namespace="llm",service="demo-tandem-router"' in query, query
            name, labels = query_metric(query)
            names.setdefault(role, {})[name] = labels
            if "role" in labels:
                assert labels["role"] == role, query
    assert set(names["prefill"]) == {
        "tandem:router_prefill_backlog_tokens",
        "tandem:router_time_to_first_token_seconds_window",
        "tandem:router_role_num_requests_waiting",
    }
    assert set(names["decode"]) == {
        "tandem:router_role_kv_cache_usage_perc",
        "tandem:router_inter_token_latency_seconds_window",
        "tandem:router_role_num_requests_waiting",
    }


def test_thresholds_choose_triggers_and_selector() -> None:
    values = _values(
        keda={
            "metricSelector": 'job="llm-router"',
            "authenticationRef": "prom",
            "authModes": "bearer",
            "prefill": {
                "ttftP90Seconds": 0,
                "waitingRequestsPerReplica": 0,
                "backlogTokensPerReplica": 4096,
            },
        }
    )
    obj = scaled_objects(render(values))["prefill"]
    assert _errors(obj) == []
    (trigger,) = obj["spec"]["triggers"]
    assert (
        trigger["metadata"]["query"]
        == 'sum(tandem:router_prefill_backlog_tokens{job="llm-router"})'
    )
    assert trigger["metadata"]["threshold"] == "4096"
    assert trigger["metricType"] == "AverageValue"
    assert trigger["authenticationRef"] == {"name": "prom"}
    assert trigger["metadata"]["authModes"] == "bearer"
    with pytest.raises(Exception, match="keda.authenticationRef needs keda.authModes"):
        render(_values(keda={"authenticationRef": "prom"}))


def test_a_role_without_any_threshold_is_an_error() -> None:
    values = _values(
        keda={"decode": {"waitingRequestsPerReplica": 0, "kvCacheUsage": 0, "itlP90Seconds": 0}}
    )
    with pytest.raises(Exception, match="keda.decode: every threshold is 0"):
        render(values)


def test_keda_and_the_charts_hpa_never_scale_one_deployment() -> None:
    both = _values(prefill={"autoscaling": {"enabled": True}})
    with pytest.raises(Exception, match="prefill.autoscaling.enabled and keda.prefill"):
        render(both)
    # KEDA for prefill only: decode keeps the chart's HPA, and each Deployment has one.
    mixed = _values(keda={"decode": {"enabled": False}}, decode={"autoscaling": {"enabled": True}})
    docs = render(mixed)
    scalers = [
        o["spec"]["scaleTargetRef"]["name"]
        for o in docs
        if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")
    ]
    assert len(scalers) == len(set(scalers)), scalers
    assert set(scaled_objects(docs)) == {"prefill"}
    hpas = by_kind(tuple(docs), "HorizontalPodAutoscaler")
    assert "demo-tandem-decode" in hpas and "demo-tandem-prefill" not in hpas


def test_hpa_still_renders_without_keda() -> None:
    docs = tuple(render({role: {"autoscaling": {"enabled": True}} for role in ENGINE_ROLES}))
    assert by_kind(docs, "ScaledObject") == {}
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    for role in ENGINE_ROLES:
        assert (
            hpas[f"demo-tandem-{role}"]["spec"]["scaleTargetRef"]["name"]
            == (workload_of(docs, role)["metadata"]["name"])
        )


@pytest.mark.parametrize("grace_s", [60, 300])
@pytest.mark.parametrize("role", ENGINE_ROLES)
def test_scale_down_drains_before_the_pod_goes(role: str, grace_s: int) -> None:
    """A pod KEDA's HPA removes gets SIGTERM at once (no preStop hook delays it: the
    engine leaves the Redis registry itself, so the routers stop sending before any
    endpoint update), drains for --shutdown-grace-s, and has 10 s left to exit before
    the kubelet's SIGKILL at terminationGracePeriodSeconds."""
    docs = render(_values(**{role: {"terminationGracePeriodSeconds": grace_s}}))
    deployment = workload_of(tuple(docs), role)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace_s
    (container,) = containers(deployment)
    assert "preStop" not in container.get("lifecycle", {})
    assert float(flag_values(container)["--shutdown-grace-s"]) == grace_s - 10
    behavior = scaled_objects(docs)[role]["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
    assert behavior["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 60}
    ]


def test_router_latency_window_is_a_value() -> None:
    """router.metricsWindowSeconds is the window the TTFT / ITL triggers read."""
    docs = tuple(render(_values(router={"metricsWindowSeconds": 120})))
    (router,) = containers(workload_of(docs, "router"))
    assert flag_values(router)["--metrics-window-s"] == "120"
    (router,) = containers(workload_of(manifests("default"), "router"))
    assert flag_values(router)["--metrics-window-s"] == "60"
