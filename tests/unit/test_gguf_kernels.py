"""The GGUF quantized linear kernels (kernels/csrc/gguf_quant_cpu.c via kernels/gguf_linear.py)
against dequantize-then-matmul, on every native ISA variant this CPU can run (the others are
compiled by test_kernels_native.py)."""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import TYPE_NAMES, random_blocks

from tandem.kernels import gguf_linear, gguf_quants
from tandem.kernels.gguf_linear import GGUFEmbedding, GGUFLinear, QuantizedPart


def _part(name: str, rows: int, cols: int, seed: int = 0) -> QuantizedPart:
    return QuantizedPart(gguf_quants.BY_NAME[name].type_id, random_blocks(name, rows, cols, seed))


def _assert_float32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` equals ``x @ w.T`` up to float32 rounding of a K-term sum in any order:
    |error| <= K * 2^-23 * (|x| @ |w|^T) elementwise, against a float64 reference."""
    ref = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error/bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("rows", [1, 3, 16, 128])
@pytest.mark.parametrize("name", TYPE_NAMES)
def test_matmul_equals_dequantize_then_matmul(native_variant, name, rows):
    """Batch 1 (fused path on SIMD builds), 3 (a partial row group), 16 and a prefill
    size straight through the kernel, each type."""
    K, N = 512, 48
    part = _part(name, N, K)
    x = torch.randn(rows, K)
    got = gguf_linear.gguf_matmul(x, part)
    _assert_float32_close(got, x, gguf_quants.dequantize(part.type_id, part.raw, K))


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_native_dequantize_rows_equals_reference(native_variant, name):
    part = _part(name, 12, 256, seed=1)
    want = gguf_quants.dequantize(part.type_id, part.raw, 256)
    assert torch.equal(gguf_linear.dequantize_rows(part, 256), want)
    ids = torch.tensor([5, 0, 11, 5])
    assert torch.equal(gguf_linear.dequantize_rows(part, 256, ids=ids), want[ids])
    bf16 = gguf_linear.dequantize_rows(part, 256, torch.bfloat16, ids)
    assert torch.equal(bf16, want[ids].to(torch.bfloat16))


def test_kernel_path_matches_the_variant(native_variant):
    want = {"avx2": gguf_linear.PATH_AVX2, "avx512": gguf_linear.PATH_AVX512,
            "avx512bf16": gguf_linear.PATH_AVX512, "amx": gguf_linear.PATH_AVX512}
    assert native_variant.gguf_matmul_path() == want.get(native_variant.variant,
                                                         gguf_linear.PATH_SCALAR)


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_linear_of_mixed_parts_with_bias(native_variant, rows):
    """A fused projection of a Q4_K part and a Q6_K part (as Q4_K_M's q/k and v), bf16
    activations, below and above DENSE_MIN_ROWS."""
    K = 512
    parts = [_part("Q4_K", 32, K, 2), _part("Q6_K", 16, K, 3)]
    bias = torch.randn(48).to(torch.bfloat16)
    layer = GGUFLinear(parts, K, bias, "blk.0.attn_qkv")
    x = torch.randn(2, rows, K).to(torch.bfloat16)
    w = torch.cat([gguf_quants.dequantize(p.type_id, p.raw, K) for p in parts])
    y = layer(x)
    assert y.shape == (2, rows, 48) and y.dtype == torch.bfloat16
    want = (x.float() @ w.T).to(torch.bfloat16) + bias
    # two bf16 roundings (output, + bias) on outputs of magnitude ~100
    scale = float(want.float().abs().max())
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)


def test_embedding_reads_only_its_rows(native_variant):
    part = _part("Q8_0", 100, 64, 4)
    emb = GGUFEmbedding(part, 64, torch.bfloat16, "token_embd.weight")
    ids = torch.tensor([[3, 99], [0, 3]])
    want = gguf_quants.dequantize(part.type_id, part.raw, 64)[ids].to(torch.bfloat16)
    assert torch.equal(emb(ids), want)
    with pytest.raises(IndexError):
        emb(torch.tensor([100]))


def test_torch_fallback_without_native_library(monkeypatch):
    monkeypatch.setattr(gguf_linear, "_lib", lambda: None)
    part = _part("Q4_1", 8, 64)
    x = torch.randn(2, 64)
    w = gguf_quants.dequantize(part.type_id, part.raw, 64)
    torch.testing.assert_close(GGUFLinear([part], 64)(x), x @ w.T)


def test_corrupted_layer_names_the_tensor():
    part = QuantizedPart(3, random_blocks("Q4_1", 8, 64)[:, :-2])  # a short block per row
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight: Q4_1 \[8, 64\] needs"):
        GGUFLinear([part], 64, name="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight: GGUF quantization type 99"):
        GGUFLinear([QuantizedPart(99, part.raw)], 64, name="blk.1.ffn_up.weight")
