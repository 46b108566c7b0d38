"""The W4A8 kernel (kernels/csrc/int4_linear_cpu.c via kernels/quant/int4_native.py) against
the torch reference ``w4a8_group_linear``, bit for bit, on every native ISA variant this
CPU can run and every kernel path each variant runs here (the other variants are compiled
by test_kernels_native.py); the reference against integer arithmetic; and ``Int4Linear``
(on-load int4) on the kernel and without it."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.quantization.grouped_linear import Int4Linear
from tandem.engine.quantization.methods import quantize_int4_groups
from tandem.kernels import backend
from tandem.kernels.quant import int4_native, int8_native
from tandem.kernels.quant.grouped import grouped_linear_reference, w4a8_group_linear
from tandem.kernels.quant.packing import from_canonical, to_canonical


def _weight(n: int, k: int, group_size: int, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values [n, k] 0..15, canonical q, scales [n, k / group_size])``, with the
    extreme nibbles 0 and 15 in the first row."""
    g = torch.Generator().manual_seed(seed)
    values, scales, _ = quantize_int4_groups(torch.randn(n, k, generator=g), group_size)
    values[0, 0], values[0, 1] = 0, 15
    return values, to_canonical(values, 4), scales


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[0, 1] = -float(x[0].abs().max())  # quantizes to -127 against the nibble 15
    x[0, 0] = 0.5 * float(x[0].abs().max())  # x / sx a half integer, nearly
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 130])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_every_path_equals_the_reference(native_variant, group_size, m, dtype):
    """Batch 1, a partial row tile (3), 16 and a prefill size (130 = 32 tiles of 4 and a
    tile of 2); N off the 16 grid (zero padding), with a bias."""
    n, k = 72, 384
    _, q, s = _weight(n, k, group_size)
    bias = torch.randn(n)
    x = _x(m, k, dtype)
    packed = int4_native.pack_int4(q, s, group_size)
    assert packed is not None
    want = w4a8_group_linear(x, q, s, group_size, bias)
    for path in int8_native.available_paths(native_variant):
        got = int4_native.int4_linear(x, packed, bias, path)
        assert got.dtype == dtype
        assert torch.equal(got, want), f"path {path} differs"


def test_decode_shapes_without_bias(native_variant):
    """The default model's projection shapes at batch 1 (group 64 on 576 inputs, 128 on
    1536), each path, no bias."""
    for n, k, group_size in ((960, 576, 64), (3072, 576, 64), (576, 1536, 128)):
        _, q, s = _weight(n, k, group_size, seed=n)
        x = _x(1, k, torch.bfloat16)
        packed = int4_native.pack_int4(q, s, group_size)
        assert packed is not None
        want = w4a8_group_linear(x, q, s, group_size, None)
        for path in int8_native.available_paths(native_variant):
            assert torch.equal(int4_native.int4_linear(x, packed, None, path), want)


def test_reference_is_integer_sums_scaled_per_group():
    """The reference's integer part is exact: the per-group sums from int64 arithmetic,
    scaled and summed over the groups in order in float32, give its output."""
    n, k, group_size, m = 40, 256, 32, 5
    values, q, s = _weight(n, k, group_size)
    x = _x(m, k, torch.float32)
    sx = x.abs().amax(dim=1, keepdim=True) / 127.0
    xq = torch.round(x / sx).clamp(-128, 127).long()
    w = values.long() - 8
    acc = torch.einsum("mgk,ngk->gmn", xq.view(m, -1, group_size), w.view(n, -1, group_size))
    f = torch.zeros(m, n)
    for g in range(k // group_size):
        f = f + acc[g].float() * s[:, g]
    assert torch.equal(w4a8_group_linear(x, q, s, group_size, None), f * sx)


def test_close_to_the_weight_only_product():
    """W4A8 differs from the dequantized weight's product (W4A16) only by the rounding
    of the activations: within a few steps of int8."""
    n, k, group_size = 64, 512, 128
    values, q, s = _weight(n, k, group_size)
    x = _x(4, k, torch.float32)
    want = grouped_linear_reference(x, q, s, torch.full_like(s, 8.0), 4, group_size)
    got = w4a8_group_linear(x, q, s, group_size, None)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_pack_then_unpack_is_the_weight(native_variant):
    _, q, s = _weight(33, 64, 32)
    packed = int4_native.pack_int4(q, s, 32)
    assert packed is not None
    assert packed.wp.numel() == 48 * 64 // 2 and packed.ws.numel() == 48 * 2
    q2, s2 = int4_native.unpack_int4(packed)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    # channel 17 (block 1, lane 1), inputs 8..15 (unit 1): low nibbles 8..11, high 12..15
    v = from_canonical(q, 4)
    unit = packed.wp.view(3, 8, 16, 4)[1, 1, 1]
    assert torch.equal((unit & 0xF).int(), v[17, 8:12])
    assert torch.equal((unit >> 4).int(), v[17, 12:16])
    assert not bool(packed.ws.view(3, 2, 16)[2, :, 1:].any())


def test_refusals_name_the_argument(native_variant):
    _, q, s = _weight(16, 64, 32)
    with pytest.raises(ValueError, match="q must be"):
        int4_native.pack_int4(q.int(), s, 32)
    with pytest.raises(ValueError, match="group_size"):
        int4_native.pack_int4(q, s, 12)
    with pytest.raises(ValueError, match="scales must be"):
        int4_native.pack_int4(q, s[:, :1], 32)
    packed = int4_native.pack_int4(q, s, 32)
    assert packed is not None
    with pytest.raises(ValueError, match="x has 63 features"):
        int4_native.int4_linear(torch.randn(1, 63), packed, None)
    with pytest.raises(ValueError, match="path 9"):
        int4_native.int4_linear(torch.randn(1, 64), packed, None, path=9)


def _layer(values: torch.Tensor, s: torch.Tensor, group_size: int,
           bias: torch.Tensor | None) -> Int4Linear:
    n, k = values.shape
    layer = Int4Linear(k, n, [n], False, torch.bfloat16)
    layer.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
    layer.set_int4(values, s, group_size)
    return layer


def test_int4_linear_layer_keeps_one_copy(native_variant):
    """On the native library the layer keeps only the packed weight, and its output is
    the reference's; with the library gone it still runs (the reference on the
    unpacked weight)."""
    values, q, s = _weight(48, 128, 64)
    bias = torch.randn(48).bfloat16()
    layer = _layer(values, s, 64, bias)
    assert layer.q is None and layer.scales is None and layer.wp is not None
    x = _x(5, 128, torch.bfloat16).view(5, 1, 128)
    want = w4a8_group_linear(x, q, s, 64, bias)
    assert torch.equal(layer(x), want)
    with backend.selected(backend.with_native(None)):
        assert torch.equal(layer(x), want)


def test_int4_linear_layer_without_the_library():
    with backend.selected(backend.with_native(None)):
        values, q, s = _weight(20, 64, 32)
        layer = _layer(values, s, 32, None)
        assert layer.wp is None and layer.q is not None and torch.equal(layer.q, q)
        x = _x(2, 64, torch.float32)
        assert torch.equal(layer(x), w4a8_group_linear(x, q, s, 32, None))
