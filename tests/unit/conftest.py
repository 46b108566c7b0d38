"""Fixtures shared by unit test modules: the Helm chart of the Helm chart tests, and the
native ISA variants of the kernel tests (see native_variants.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from native_variants import VARIANTS, on_variant

from tandem.kernels import cpu_ext
from tandem.kernels.native_abi import NativeLibrary


@pytest.fixture(params=VARIANTS)
def native_variant(request: pytest.FixtureRequest) -> Iterator[NativeLibrary]:
    """The test once per native variant, that variant selected (skips: see on_variant)."""
    with on_variant(request.param) as lib:
        yield lib


@pytest.fixture
def bf16_variant(native_variant: NativeLibrary) -> NativeLibrary:
    """``native_variant`` where it has the AVX512-BF16 kernels (else a skip)."""
    if native_variant.bf16_linear_path() != cpu_ext.LINEAR_BF16:
        pytest.skip(f"the {native_variant.variant} variant has no AVX512-BF16 kernels")
    return native_variant


@pytest.fixture(params=[False, True], ids=["avx512bf16", "amx"])
def tiles(request: pytest.FixtureRequest, bf16_variant: NativeLibrary) -> bool:
    """The bf16 kernels with VDPBF16PS (False) and on AMX tiles (True, where the
    variant has them and Linux grants the tile state)."""
    if request.param and not bf16_variant.tiles_available:
        pytest.skip(f"no AMX tiles in the {bf16_variant.variant} variant or on this CPU")
    return request.param


@pytest.fixture(params=["fma", "avx512bf16", "amx"])
def linear_tiles(request: pytest.FixtureRequest, native_variant: NativeLibrary) -> bool:
    """The packed linear kernels on each of their paths, as ``bf16_linear``'s ``tiles``
    argument: float32 FMAs on the variants whose path is ``LINEAR_FMA`` (AVX2,
    AVX-512 without BF16), VDPBF16PS and AMX tiles as ``tiles`` has them."""
    want = cpu_ext.LINEAR_FMA if request.param == "fma" else cpu_ext.LINEAR_BF16
    if native_variant.bf16_linear_path() != want:
        pytest.skip(f"the {native_variant.variant} variant has no {request.param} linear path")
    if request.param == "amx" and not native_variant.tiles_available:
        pytest.skip(f"no AMX tiles in the {native_variant.variant} variant or on this CPU")
    return request.param == "amx"


@pytest.fixture(scope="module")
def chart() -> Iterator[object]:
    """helm/tandem loaded by the real Helm engine (a ``helm_python.Chart``), closed after the
    module. Imported here, not at the top: only the Helm tests need helm-python-sdk."""
    helm = pytest.importorskip("helm_python")
    from helm_support import CHART

    with helm.Chart.load(CHART) as loaded:
        yield loaded
