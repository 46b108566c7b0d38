"""FP8 KV cache kernels on the CPU (kernels/kv_quant.py): the cache write equals the
reference quantization, and every CPU attention path over an FP8 cache equals attention
over the dequantized cache (the native kernels never see FP8 bytes)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_ext
from tandem.kernels.attention import build_attention_metadata, paged_attention, paged_attention_ref
from tandem.kernels.attention_backend import AttentionBackend
from tandem.kernels.cache import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_layer_views,
    reshape_and_cache,
)
from tandem.kernels.kv_quant import (
    KV_CACHE_DTYPES,
    check_fp8_kv_cache_supported,
    dequantize_kv,
    quantize_kv,
    resolve_kv_cache_dtype,
    scales_id,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_clamps_and_round_trips(dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.5, 10 * top, -10 * top])
    q = quantize_kv(x, 2.0, dtype)
    assert q.dtype == dtype
    back = dequantize_kv(q, 2.0, torch.float32)
    assert torch.isfinite(back).all()
    assert back[3] == 2.0 * top and back[4] == -2.0 * top  # saturated, not NaN / inf
    torch.testing.assert_close(back[:3], x[:3])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_cache_write_equals_reference_quantization(dtype, model_dtype):
    torch.manual_seed(0)
    bs, kvh, hd = 4, 2, 16
    kv = allocate_kv_cache(6, 2, bs, kvh, hd, dtype)
    layer = kv_cache_layer_views(kv)[1]
    key = torch.randn(5, kvh, hd, dtype=model_dtype) * 3
    value = torch.randn(5, kvh, hd, dtype=model_dtype)
    slots = torch.tensor([5 * bs + 3, 0, 2 * bs + 1, 7, 13])
    reshape_and_cache(key, value, layer, slots, k_scale=0.5, v_scale=2.0)
    k_want = quantize_kv(key, 0.5, dtype)
    v_want = quantize_kv(value, 2.0, dtype)
    b, o = slots // bs, slots % bs
    assert torch.equal(layer[0][b, o].view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(layer[1][b, o].view(torch.uint8), v_want.view(torch.uint8))
    assert kv[:, 0].view(torch.uint8).eq(0).all()  # the other layer untouched


def _case(num_heads, num_kv_heads, hd, dtype, model_dtype, k_scale, v_scale, seed=1):
    """An FP8 cache with stale bytes, a step of decodes, a fresh prompt and a prefix-hit
    chunk, and the step's K/V written; returns what paged_attention takes."""
    torch.manual_seed(seed)
    bs, num_blocks = 4, 40
    seqs = [(9, 1), (16, 1), (0, 1), (22, 1), (0, 7), (5, 6)]
    kv = allocate_kv_cache(num_blocks, 1, bs, num_kv_heads, hd, torch.float32)
    kv.normal_()  # stale data in unused slots must not leak into results
    kv = kv.to(dtype)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    query = torch.randn(meta.num_tokens, num_heads, hd, dtype=model_dtype)
    key = torch.randn(meta.num_tokens, num_kv_heads, hd, dtype=model_dtype)
    value = torch.randn(meta.num_tokens, num_kv_heads, hd, dtype=model_dtype)
    reshape_and_cache(key, value, layer, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return query, key, value, layer, meta


def _dequantized_reference(query, key, value, layer, meta, k_scale, v_scale, window=None):
    """Attention over the whole cache dequantized, the new K/V rounded as cached."""
    dt = query.dtype
    kc, vc = (dequantize_kv(c, s, dt) for c, s in zip(layer, (k_scale, v_scale), strict=True))
    kq = dequantize_kv(quantize_kv(key, k_scale, layer[0].dtype), k_scale, dt)
    vq = dequantize_kv(quantize_kv(value, v_scale, layer[1].dtype), v_scale, dt)
    return paged_attention_ref(query, kq, vq, kc, vc, meta, query.shape[-1] ** -0.5, window)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("backend", [AttentionBackend.TORCH_SDPA, AttentionBackend.CPU_NATIVE])
@pytest.mark.parametrize("num_heads,num_kv_heads,window", [(4, 4, None), (6, 2, 6)])
def test_paged_attention_over_fp8_equals_dequantized(dtype, backend, num_heads, num_kv_heads,
                                                     window, monkeypatch):
    hd, ks, vs = 16, 0.75, 1.5
    query, key, value, layer, meta = _case(num_heads, num_kv_heads, hd, dtype, torch.float32,
                                           ks, vs)
    want = _dequantized_reference(query, key, value, layer, meta, ks, vs, window)
    native = cpu_ext.paged_decode_attention_cpu

    def no_fp8(q, k_cache, *args):
        assert k_cache.dtype == q.dtype, "the native kernel was handed FP8 bytes"
        return native(q, k_cache, *args)

    monkeypatch.setattr(cpu_ext, "paged_decode_attention_cpu", no_fp8)
    meta.attention_backend = backend
    got = paged_attention(query, key, value, layer, meta, hd**-0.5, window, k_scale=ks,
                          v_scale=vs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_ext.load() is None, reason="no native CPU kernels built")
def test_native_routing_bf16_prefill_kernel_reads_dequantized_blocks():
    """bf16 on the CPU's default routing (native decode and prefill kernels where the CPU
    has them): equal to the dequantized cache within bf16 rounding."""
    query, key, value, layer, meta = _case(4, 2, 32, torch.float8_e4m3fn, torch.bfloat16,
                                           1.0, 1.0)
    want = _dequantized_reference(query, key, value, layer, meta, 1.0, 1.0)
    got = paged_attention(query, key, value, layer, meta, 32**-0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_softcap_and_sinks_over_fp8_equal_dequantized():
    from tandem.kernels.attention_math import paged_attention_math

    query, key, value, layer, meta = _case(4, 2, 16, torch.float8_e4m3fn, torch.float32,
                                           0.5, 0.5)
    sinks = torch.randn(4)
    kc, vc = (dequantize_kv(c, 0.5, torch.float32) for c in layer)
    kq, vq = (dequantize_kv(quantize_kv(t, 0.5, layer[0].dtype), 0.5, torch.float32)
              for t in (key, value))
    want = paged_attention_math(query, kq, vq, kc, vc, meta, 0.25, None, 30.0, sinks)
    got = paged_attention(query, key, value, layer, meta, 0.25, softcap=30.0, sinks=sinks,
                          k_scale=0.5, v_scale=0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mla_single_component_cache():
    """An MLA latent (one view used as K and V) round-trips through an FP8 cache."""
    torch.manual_seed(2)
    kv = allocate_kv_cache(8, 1, 4, 1, 24, torch.float8_e4m3fn, num_components=1)
    layer = kv_cache_layer_views(kv)[0]
    meta = build_attention_metadata([5, 1], [0, 6], [[3, 1], [0, 6]], 4)
    entry = torch.randn(meta.num_tokens, 1, 24)
    reshape_and_cache(entry, entry, layer, meta.slot_mapping)
    query = torch.randn(meta.num_tokens, 3, 24)
    got = paged_attention(query, entry, entry, layer, meta, 0.2)
    deq = dequantize_kv(layer[0], 1.0, torch.float32)
    eq = dequantize_kv(quantize_kv(entry, 1.0, layer[0].dtype), 1.0, torch.float32)
    want = paged_attention_ref(query, eq, eq, deq, deq, meta, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp8_block_is_half_a_bf16_block():
    bf16 = kv_cache_bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.float8_e4m3fn) * 2 == bf16
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.float32) == 2 * bf16


def test_resolve_and_bad_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2
    assert KV_CACHE_DTYPES == ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("int8", torch.float32)


def test_unsupported_device_is_a_clear_error():
    check_fp8_kv_cache_supported(torch.float8_e4m3fn, "cpu")
    check_fp8_kv_cache_supported(torch.bfloat16, "cuda", (7, 0))
    check_fp8_kv_cache_supported(torch.float8_e4m3fn, "cuda", (9, 0))
    check_fp8_kv_cache_supported(torch.float8_e5m2, "cuda", (8, 0))
    with pytest.raises(ValueError, match=r"kv_cache_dtype: float8_e4m3fn .* 8\.9.* 8\.0"):
        check_fp8_kv_cache_supported(torch.float8_e4m3fn, "cuda", (8, 0))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        check_fp8_kv_cache_supported(torch.float8_e5m2, "cuda", (7, 5))


def test_scales_id_is_stable_and_distinguishes():
    one = scales_id([(1.0, 1.0)] * 3)
    assert one == scales_id([(1.0, 1.0)] * 3) and len(one) == 16
    assert one != scales_id([(1.0, 1.0)] * 2 + [(0.5, 1.0)])
