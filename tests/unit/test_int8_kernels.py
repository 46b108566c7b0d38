"""The W8A8 kernel (kernels/csrc/int8_linear_cpu.c via kernels/quant/int8_native.py) against
the torch reference ``int8_rowwise_linear``, bit for bit, on every native ISA variant this
CPU can run and every kernel path each variant runs here (the other variants are compiled
by test_kernels_native.py); and ``Int8Linear`` on the kernel and without it."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.quantization.dense_linear import Int8Linear, quantize_int8_rows
from tandem.kernels import backend
from tandem.kernels.quant import int8_native
from tandem.kernels.quant.grouped import int8_rowwise_linear


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return quantize_int8_rows(torch.randn(n, k, generator=g))


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 0] = 0.5 * float(x[0].abs().max())  # one value with x / sx a half integer, nearly
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 130])
def test_every_path_equals_the_reference(native_variant, m, dtype):
    """Batch 1, a partial row tile (3), 16 and a prefill size (130 = 32 tiles of 4 and a
    tile of 2); N and K off the 16 / 4 grid (zero padding), with a bias."""
    n, k = 72, 262
    q, s = _weight(n, k)
    bias = torch.randn(n)
    x = _x(m, k, dtype)
    packed = int8_native.pack_int8(q)
    assert packed is not None
    want = int8_rowwise_linear(x, q, s, bias)
    paths = int8_native.available_paths(native_variant)
    for path in paths:
        got = int8_native.int8_linear(x, packed, s, bias, path)
        assert got.dtype == dtype
        assert torch.equal(got, want), f"path {path} differs"


def test_decode_shapes_without_bias(native_variant):
    """The default model's projection shapes at batch 1, each path, no bias."""
    x = _x(1, 576, torch.bfloat16)
    for n in (960, 576, 3072):
        q, s = _weight(n, 576, seed=n)
        packed = int8_native.pack_int8(q)
        assert packed is not None
        want = int8_rowwise_linear(x, q, s, None)
        for path in int8_native.available_paths(native_variant):
            assert torch.equal(int8_native.int8_linear(x, packed, s, None, path), want)


def test_paths_of_the_variant(native_variant):
    """Each build runs its own SIMD path: AVX2 from the avx2 variant up; the VNNI paths
    exactly where the CPU has the instructions (chosen at run time)."""
    paths = int8_native.available_paths(native_variant)
    flags = backend.current().platform.cpu_flags
    simd = native_variant.variant not in ("generic", "baseline")
    assert paths[0] == int8_native.PATH_SCALAR
    assert (int8_native.PATH_AVX2 in paths) == simd
    assert (int8_native.PATH_AVX_VNNI in paths) == (simd and "avx_vnni" in flags)
    wide = native_variant.variant in ("avx512", "avx512bf16", "amx")
    assert (int8_native.PATH_AVX512_VNNI in paths) == (wide and "avx512_vnni" in flags)


def test_pack_then_unpack_is_the_weight(native_variant):
    q, _ = _weight(33, 70)
    packed = int8_native.pack_int8(q)
    assert packed is not None
    assert torch.equal(int8_native.unpack_int8(packed), q)
    assert torch.equal(packed.wsum[:33], q.int().sum(dim=1))
    assert not bool(packed.wsum[33:].any())


def test_refusals_name_the_argument(native_variant):
    q, s = _weight(16, 32)
    with pytest.raises(ValueError, match="q must be"):
        int8_native.pack_int8(q.float())
    packed = int8_native.pack_int8(q)
    assert packed is not None
    with pytest.raises(ValueError, match="x has 31 features"):
        int8_native.int8_linear(torch.randn(1, 31), packed, s, None)
    with pytest.raises(ValueError, match="path 9"):
        int8_native.int8_linear(torch.randn(1, 32), packed, s, None, path=9)


def _layer(q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    n, k = q.shape
    layer = Int8Linear(k, n, [n], False, torch.bfloat16)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    layer.set_int8(q, s)
    return layer


def test_int8_linear_layer_keeps_one_copy(native_variant):
    """On the native library the layer keeps only the packed weight, and its output is
    the reference's; with the library gone it still runs (the reference on the
    unpacked weight)."""
    q, s = _weight(48, 64)
    bias = torch.randn(48).bfloat16()
    layer = _layer(q, s, bias)
    assert layer.q is None and layer.wp is not None
    x = _x(5, 64, torch.bfloat16).view(5, 1, 64)
    want = int8_rowwise_linear(x, q, s, bias)
    assert torch.equal(layer(x), want)
    with backend.selected(backend.with_native(None)):
        assert torch.equal(layer(x), want)


def test_int8_linear_layer_without_the_library():
    with backend.selected(backend.with_native(None)):
        q, s = _weight(20, 12)
        layer = _layer(q, s, None)
        assert layer.wp is None and layer.q is not None and torch.equal(layer.q, q)
        x = _x(2, 12, torch.float32)
        assert torch.equal(layer(x), int8_rowwise_linear(x, q, s, None))
