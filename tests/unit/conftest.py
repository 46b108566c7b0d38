"""Fixtures shared by unit test modules: the Helm chart of the Helm chart tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def chart() -> Iterator[object]:
    """helm/tandem loaded by the real Helm engine (a ``helm_python.Chart``), closed after the
    module. Imported here, not at the top: only the Helm tests need helm-python-sdk."""
    helm = pytest.importorskip("helm_python")
    from helm_support import CHART

    with helm.Chart.load(CHART) as loaded:
        yield loaded
