"""The GGUF integer-dot kernel (kernels/csrc/gguf_dot_cpu.c via kernels/gguf_dot.py) against
its float64 oracle ``gguf_dot_ref`` (the same quantized operands) and against
dequantize-then-matmul (within the activation quantization error), on every native ISA
variant this CPU can run and every kernel path each variant runs here."""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import random_blocks

from tandem.kernels import gguf_dot, gguf_quants
from tandem.kernels.quant.int8_native import available_paths

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(name: str, n: int, k: int, seed: int = 0) -> tuple[int, torch.Tensor]:
    return gguf_quants.BY_NAME[name].type_id, random_blocks(name, n, k, seed)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    return x.to(dtype)


def _assert_near_ref(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, k: int) -> None:
    tol = (k // 32 + 4) * 2.0**-23 * bound + 1e-30
    if got.dtype == torch.bfloat16:
        tol = tol + 2.0**-8 * want.abs()  # the output's rounding to bf16
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"max error/tolerance {float((err / tol).max()):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 130])
@pytest.mark.parametrize("name", TYPES)
def test_every_path_equals_the_reference(native_variant, name, m, dtype):
    """Batch 1, a partial row tile (3), 16 and a prefill size (130); N off the 16-row
    grid (zero padding), with a bias."""
    n, k = 72, 256
    type_id, raw = _blocks(name, n, k)
    bias = torch.randn(n)
    x = _x(m, k, dtype)
    packed = gguf_dot.pack_gguf(type_id, raw, k)
    assert packed is not None
    want, bound = gguf_dot.gguf_dot_ref(x, type_id, raw, k, bias)
    for path in available_paths(native_variant):
        got = gguf_dot.gguf_dot_linear(x, packed, bias, path)
        assert got.dtype == dtype and got.shape == (m, n)
        _assert_near_ref(got, want, bound, k)


@pytest.mark.parametrize("name", TYPES)
def test_close_to_dequantize_then_matmul(native_variant, name):
    """The activation quantization error is at most half a step per element:
    |y - x @ W^T| <= sum_blocks da / 2 * sum |w| (+ float32 rounding)."""
    n, k = 48, 576
    type_id, raw = _blocks(name, n, k, seed=3)
    x = _x(4, k, torch.float32, seed=4)
    packed = gguf_dot.pack_gguf(type_id, raw, k)
    assert packed is not None
    w = gguf_quants.dequantize(type_id, raw, k).double()
    exact = x.double() @ w.T
    _, da, _ = gguf_dot.quantize_activations(x)
    wabs = w.abs().reshape(n, k // 32, 32).sum(-1)  # [N, KB]
    bound = 0.5 * da.double() @ wabs.T + 1e-3 * exact.abs() + 1e-6
    got = gguf_dot.gguf_dot_linear(x, packed)
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error/bound {float((err / bound).max()):.3g}"
    assert float(err.max()) > 0  # the activations were quantized: not an exact float GEMM


@pytest.mark.parametrize("name", TYPES)
def test_pack_then_unpack_is_the_blocks(native_variant, name):
    type_id, raw = _blocks(name, 35, 96, seed=5)
    packed = gguf_dot.pack_gguf(type_id, raw, 96)
    assert packed is not None
    assert packed.wp.shape == (3, 3, 16 * gguf_quants.BY_NAME[name].type_size)
    assert torch.equal(gguf_dot.unpack_gguf(packed), raw)
    ids = torch.tensor([34, 0, 17, 17])
    assert torch.equal(gguf_dot.unpack_gguf(packed, ids), raw[ids])
    # the 13 padding rows of the last tile are zero weights: scale (and Q4_1 min) 0
    padded = gguf_dot.PackedGGUF(type_id, packed.wp, 48, 96)
    pad = gguf_dot.unpack_gguf(padded)[35:].reshape(13, 3, -1)
    assert not bool(pad[..., : 4 if name == "Q4_1" else 2].any())


def test_default_model_shapes_at_batch_1(native_variant):
    """The default model's projections (Q4_1) and tied head shape (Q8_0, rows cut)."""
    x = _x(1, 576, torch.bfloat16, seed=6)
    for name, n in (("Q4_1", 960), ("Q4_1", 3072), ("Q8_0", 1024)):
        type_id, raw = _blocks(name, n, 576, seed=n)
        packed = gguf_dot.pack_gguf(type_id, raw, 576)
        assert packed is not None
        want, bound = gguf_dot.gguf_dot_ref(x, type_id, raw, 576)
        for path in available_paths(native_variant):
            _assert_near_ref(gguf_dot.gguf_dot_linear(x, packed, None, path), want, bound, 576)


def test_an_unknown_path_is_refused(native_variant):
    type_id, raw = _blocks("Q4_1", 16, 64)
    packed = gguf_dot.pack_gguf(type_id, raw, 64)
    assert packed is not None
    with pytest.raises(ValueError, match="path 99"):
        gguf_dot.gguf_dot_linear(torch.zeros(1, 64), packed, None, 99)
    with pytest.raises(ValueError, match="float32/bf16"):
        gguf_dot.gguf_dot_linear(torch.zeros(1, 64, dtype=torch.float16), packed)
