"""helm/tandem: ``<role>.scheduler.schedulingPolicy`` -> the engines' ``--scheduling-policy``,
checked by the values schema and accepted by the real ``tandem <role>`` CLI."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from helm_support import (  # noqa: E402  (after the importorskip)
    NAMESPACE,
    RELEASE,
    cli_options,
    containers,
    flag_values,
    workload_of,
)


def engine_flags(chart: Any, values: dict[str, Any]) -> dict[str, dict[str, str]]:
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = tuple(
        doc for path, text in sorted(files.items()) if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text) if doc
    )
    return {role: flag_values(containers(workload_of(docs, role))[0])
            for role in ("prefill", "decode")}


def test_scheduling_policy_renders_per_role(chart: Any) -> None:
    flags = engine_flags(chart, {"decode": {"scheduler": {"schedulingPolicy": "priority"}}})
    assert flags["decode"]["--scheduling-policy"] == "priority"
    assert "--scheduling-policy" not in flags["prefill"]  # null: the engine's default


def test_scheduling_policy_default_leaves_the_flag_out(chart: Any) -> None:
    flags = engine_flags(chart, {})
    assert all("--scheduling-policy" not in f for f in flags.values())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_cli_accepts_the_rendered_policies(role: str) -> None:
    assert cli_options(role)["--scheduling-policy"] == frozenset({"fcfs", "priority"})


def test_schema_rejects_unknown_policy(chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as info:
        chart.render({"prefill": {"scheduler": {"schedulingPolicy": "lifo"}}}, name=RELEASE)
    assert "/prefill/scheduler/schedulingPolicy" in str(info.value)
