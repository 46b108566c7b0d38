"""The chart's ``kvstore.disk`` values: a disk tier per store pod (``--disk-path``,
``--disk-capacity``) on an emptyDir or a hostPath volume mounted at the path; none by
default."""

from __future__ import annotations

import pytest

helm = pytest.importorskip("helm_python")

from helm_support import (  # noqa: E402  (after the importorskip)
    CHART,
    containers,
    flag_values,
    manifests,
    workload_of,
)


def _kvstore(name: str) -> tuple[dict, dict]:
    w = workload_of(manifests(name), "kvstore")
    (c,) = [c for c in containers(w) if c["name"] == "kvstore"]
    return w, c


def _disk_volume(w: dict) -> dict:
    (vol,) = [v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "kv-disk"]
    return vol


def test_a_local_ssd_host_path_backs_the_daemonset_disk_tier() -> None:
    w, c = _kvstore("production")
    assert w["kind"] == "DaemonSet"
    flags = flag_values(c)
    assert flags["--disk-path"] == "/var/lib/tandem/kvstore"
    assert flags["--disk-capacity"] == str(800 * 2**30)
    assert {"name": "kv-disk", "mountPath": "/var/lib/tandem/kvstore"} in c["volumeMounts"]
    assert _disk_volume(w)["hostPath"] == {
        "path": "/mnt/nvme0/tandem-kv",
        "type": "DirectoryOrCreate",
    }


def test_an_empty_dir_with_headroom_backs_the_statefulset_disk_tier() -> None:
    w, c = _kvstore("hostpath-nodeport")
    assert w["kind"] == "StatefulSet"
    assert flag_values(c)["--disk-capacity"] == str(50 * 2**30)
    vol = _disk_volume(w)
    assert "hostPath" not in vol
    assert int(vol["emptyDir"]["sizeLimit"]) == 50 * 2**30 + 5 * 2**30


def test_no_disk_tier_by_default() -> None:
    w, c = _kvstore("default")
    assert not any(a.startswith("--disk-") for a in c.get("args", []))
    assert all(v["name"] != "kv-disk" for v in w["spec"]["template"]["spec"]["volumes"])


def test_schema_rejects_a_relative_mount_path() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="mountPath"):
        chart.render({"kvstore": {"disk": {"enabled": True, "mountPath": "kv"}}})
