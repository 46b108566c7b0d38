"""The Helm chart (helm/tandem): lint, render and schema checks with the real Helm engine.

`helm_python.lint` is `helm lint`; `Chart.render` is `helm template` including the
values.schema.json check that `helm install` runs. Every rendered manifest is validated
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail).
The wiring between the parts is checked in test_helm_wiring.py, the image in
test_helm_image.py.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from helm_support import (  # noqa: E402  (after the importorskips)
    CHART,
    ENGINE_ROLES,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    REPO,
    TANDEM_ROLES,
    VALUE_SETS,
    by_kind,
    component,
    manifests,
    merge,
    render,
    workload_of,
)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_clean(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name] or None, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_manifests_valid_kubernetes(name: str) -> None:
    docs = manifests(name)
    assert len(docs) >= 10
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            # A Prometheus Operator CRD: no built-in schema; checked by its own test.
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        if doc["kind"] == "ScaledObject":
            # A KEDA CRD: checked against its schema by test_helm_keda.py.
            assert doc["apiVersion"] == "keda.sh/v1alpha1"
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}) "
                    f"at {where}: {e.message}"
                )


def test_default_renders_every_component() -> None:
    docs = manifests("default")
    kinds = {
        (d["kind"], component(d))
        for d in docs
        if "app.kubernetes.io/component" in d["metadata"].get("labels", {})
    }
    for role in ("router", "prefill", "decode"):
        assert ("Deployment", role) in kinds
        assert ("Service", role) in kinds
        assert ("PodDisruptionBudget", role) in kinds
    assert ("StatefulSet", "kvstore") in kinds
    assert ("StatefulSet", "redis") in kinds
    assert ("Service", "redis") in kinds
    present = {d["kind"] for d in docs}
    assert {"ConfigMap", "ServiceAccount", "NetworkPolicy"} <= present
    # Optional objects stay off by default.
    assert present.isdisjoint({"Ingress", "HorizontalPodAutoscaler", "ServiceMonitor", "DaemonSet"})


def test_notes_tell_how_to_reach_router() -> None:
    files, _ = render("default")
    notes = files["tandem/templates/NOTES.txt"]
    assert f"port-forward svc/{RELEASE}-tandem-router 8000:80" in notes
    assert "/v1/chat/completions" in notes
    ingress_notes = render("ingress")[0]["tandem/templates/NOTES.txt"]
    assert "https://llm.example.org" in ingress_notes


@pytest.mark.parametrize("role", TANDEM_ROLES)
def test_schema_rejects_negative_replicas(chart: Any, role: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=rf"/{role}/replicas.*minimum"):
        chart.render({role: {"replicas": -1}}, name=RELEASE)


def test_schema_rejects_missing_model_path(chart: Any) -> None:
    # null deletes a key in Helm's value merge: the user "unset" model.path.
    with pytest.raises(helm.HelmValuesError, match=r"/model.*missing property 'path'"):
        chart.render({"model": {"path": None}}, name=RELEASE)
    with pytest.raises(helm.HelmValuesError, match=r"/model/path"):
        chart.render({"model": {"path": ""}}, name=RELEASE)
    report = helm.lint(CHART, {"model": {"path": None}})
    assert any("missing property 'path'" in e for e in report["errors"])


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"redis": {"enabled": False}}, "/redis/external"),
        ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
        ({"model": {"source": "hostPath"}}, "/model/hostPath/path"),
        ({"prefill": {"gpus": -1}}, "/prefill/gpus"),
        ({"decode": {"gpus": -2}}, "/decode/gpus"),
        ({"decode": {"tensorParallelSize": 0}}, "/decode/tensorParallelSize"),
        ({"prefill": {"pipelineParallelSize": 0}}, "/prefill/pipelineParallelSize"),
        ({"decode": {"replica": 2}}, "'replica' not allowed"),
        ({"router": {"routingPolicy": "random"}}, "/router/routingPolicy"),
        ({"cache": {"blockSize": 24}}, "/cache/blockSize"),
        ({"kvstore": {"capacity": 0}}, "/kvstore/capacity"),
        ({"kvstore": {"kind": "Deployment"}}, "/kvstore/kind"),
        ({"prefill": {"scheduler": {"maxNumSeqs": 0}}}, "/prefill/scheduler/maxNumSeqs"),
        ({"router": {"port": 70000}}, "/router/port"),
        ({"ucx": {"env": {"TLS": "tcp"}}}, "/ucx/env"),
        ({"decode": {"speculative": {"method": "eagle"}}}, "/decode/speculative/method"),
        ({"decode": {"speculative": {"method": "ngram", "numSpeculativeTokens": 17}}},
         "/decode/speculative/numSpeculativeTokens"),
        ({"internalTLS": {"enabled": True}}, "/internalTLS/secretName"),
    ],
)
def test_schema_rejects_bad_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render(values, name=RELEASE)
    assert where in str(info.value)


def test_gpus_must_match_the_engine_workers(chart: Any) -> None:
    # One GPU per worker process: a pod with fewer would leave a rank without a device,
    # more would idle.
    with pytest.raises(Exception, match=r"decode.gpus \(2\) must be decode.tensorParallelSize"):
        chart.render({"decode": {"gpus": 2}}, name=RELEASE)
    values = {"decode": {"gpus": 0, "tensorParallelSize": 2}}
    assert chart.render(values, name=RELEASE)  # CPU: the workers share the pod's CPUs


def test_values_yaml_documents_every_schema_key(chart: Any) -> None:
    """values.yaml is the documentation: each top-level schema key has a default there."""
    assert set(chart.schema["properties"]) - {"global"} == set(chart.values)


def test_docs_values_examples_render(chart: Any) -> None:
    """Every values snippet in docs/deploy.md passes the schema and renders."""
    text = (REPO / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    for block in blocks:
        values = yaml.safe_load(block)
        assert set(values) <= set(chart.schema["properties"]), values
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
        assert any(name.endswith("router-deployment.yaml") for name in files)


@pytest.mark.parametrize(("doc", "min_commands"), [("docs/deploy.md", 2), ("README.md", 0)])
def test_docs_helm_install_commands_render(chart: Any, doc: str, min_commands: int) -> None:
    """The `helm install ... --set` commands in the docs pass the schema and render."""
    text = (REPO / doc).read_text().replace("\\\n", " ")
    commands = [line for line in text.splitlines() if line.startswith("helm install ")]
    assert len(commands) >= min_commands
    for command in commands:
        args = shlex.split(command)
        values: dict[str, Any] = {}
        for flag, value in zip(args, args[1:], strict=False):
            if flag == "--set":
                merge(values, helm.parse_set_string(value))
        docs = [
            d
            for f, t in chart.render(values, name="tandem").items()
            if f.endswith(".yaml")
            for d in yaml.safe_load_all(t)
            if d
        ]
        if values.get("prefill", {}).get("replicas"):
            assert workload_of(tuple(docs), "prefill")["spec"]["replicas"] == 3


def test_network_policies_let_only_the_callers_of_each_part_in() -> None:
    """Only the router reaches prefill/decode, only the engines the KV store, only tandem's
    pods the bundled Redis; metrics ports stay scrapeable; nothing restricts the router;
    ``networkPolicy.enabled=false`` renders none (the objects validate with the rest)."""
    docs = manifests("default")
    policies = by_kind(docs, "NetworkPolicy")

    def callers(role: str) -> list[set[str]]:
        pol = policies[f"{RELEASE}-tandem-{role}"]
        assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == role
        return [{p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                 for p in rule.get("from", [])} for rule in pol["spec"]["ingress"]]

    for role in ENGINE_ROLES:
        assert callers(role) == [{"router"}, set()]  # grpc from the router; metrics open
    assert callers("kvstore") == [{"prefill", "decode"}, set()]
    assert callers("redis") == [{"router", "prefill", "decode", "kvstore"}]
    assert f"{RELEASE}-tandem-router" not in policies
    with helm.Chart.load(CHART) as loaded:
        files = loaded.render({"networkPolicy": {"enabled": False}}, name=RELEASE,
                              namespace=NAMESPACE, is_install=True)
    assert not files.get("tandem/templates/networkpolicy.yaml", "").strip()


def test_expert_parallel_needs_tensor_parallel_workers(chart: Any) -> None:
    with pytest.raises(Exception, match=r"prefill.enableExpertParallel needs "
                                        r"prefill.tensorParallelSize >= 2"):
        chart.render({"prefill": {"enableExpertParallel": True}}, name=RELEASE)


def test_quantization_enum_is_the_engines(chart: Any) -> None:
    """The chart's --quantization choices are the engine's (one list, no drift)."""
    from tandem.engine.quantization import QUANTIZATION_METHODS

    enum = chart.schema["properties"]["model"]["properties"]["quantization"]["enum"]
    assert set(enum) == {None, *QUANTIZATION_METHODS}
