"""helm/tandem: ``router.apiKeys.existingSecret`` mounts that Secret's file read-only and
passes it as the router's ``--api-keys``, a flag the real ``tandem router`` takes."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from helm_support import NAMESPACE, RELEASE, containers, flag_values, workload_of  # noqa: E402

from tandem.services.router.main import build_parser  # noqa: E402


def router_pod(chart: Any, values: dict[str, Any]) -> dict[str, Any]:
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = tuple(doc for path, text in sorted(files.items()) if not path.endswith("NOTES.txt")
                 for doc in yaml.safe_load_all(text) if doc)
    return workload_of(docs, "router")["spec"]["template"]["spec"]


def test_api_keys_secret_is_mounted_and_passed(chart: Any) -> None:
    pod = router_pod(chart, {"router": {"apiKeys": {"existingSecret": "tenants"}}})
    (router,) = containers({"spec": {"template": {"spec": pod}}})
    path = flag_values(router)["--api-keys"]
    assert path == "/etc/tandem/api-keys/api-keys.yaml"
    mount = next(m for m in router["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/tandem/api-keys", "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {"secretName": "tenants", "items": [
        {"key": "api-keys.yaml", "path": "api-keys.yaml"}]}
    assert build_parser().parse_args(["--api-keys", path]).api_keys == path


def test_no_secret_no_flag_no_volume(chart: Any) -> None:
    pod = router_pod(chart, {})
    (router,) = containers({"spec": {"template": {"spec": pod}}})
    assert "--api-keys" not in flag_values(router)
    assert all(v["name"] != "api-keys" for v in pod.get("volumes", []))


def test_schema_rejects_unknown_api_keys_field(chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render({"router": {"apiKeys": {"secret": "x"}}}, name=RELEASE)
    assert "apiKeys" in str(info.value)
