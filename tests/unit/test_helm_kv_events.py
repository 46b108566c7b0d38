"""helm/tandem: ``kvEvents.enabled`` (on by default) -> the engines' ``--kv-events`` /
``--no-kv-events``, both options of the real ``tandem prefill|decode`` CLI."""

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
    workload_of,
)


def engine_args(chart: Any, values: dict[str, Any]) -> dict[str, list[str]]:
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = tuple(
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    )
    return {role: containers(workload_of(docs, role))[0]["args"] for role in ("prefill", "decode")}


@pytest.mark.parametrize(("enabled", "flag"), [(True, "--kv-events"), (False, "--no-kv-events")])
def test_kv_events_value_renders_the_engine_flag(chart: Any, enabled: bool, flag: str) -> None:
    values = {} if enabled else {"kvEvents": {"enabled": False}}
    for role, args in engine_args(chart, values).items():
        assert flag in args, role
        assert flag in cli_options(role)


def test_schema_refuses_a_non_boolean(chart: Any) -> None:
    with pytest.raises(Exception, match="kvEvents"):
        engine_args(chart, {"kvEvents": {"enabled": "yes"}})
