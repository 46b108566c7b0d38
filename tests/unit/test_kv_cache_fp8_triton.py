"""FP8 KV cache through the Triton kernels (the cache write and the decode kernel that
loads FP8 and upcasts), on the CPU via Triton's interpreter as
``tests/unit/test_kernels_triton.py`` runs them (see there for why a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - opt-out
    pytest.skip("TRITON_INTERPRET is not 1", allow_module_level=True)
in_process = pytest.mark.skipif(
    _TRITON_PREIMPORTED, reason="triton imported without the interpreter: see the rerun"
)


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="running in this process")
def test_rerun_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


from tandem.kernels import kv_quant  # noqa: E402
from tandem.kernels.attention import (  # noqa: E402
    build_attention_metadata,
    paged_attention,
    paged_attention_ref,
)
from tandem.kernels.attention_backend import AttentionBackend  # noqa: E402
from tandem.kernels.cache import allocate_kv_cache, reshape_and_cache_triton  # noqa: E402
from tandem.kernels.kv_quant import dequantize_kv, quantize_kv  # noqa: E402


@in_process
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_cache_write_of_fp8_bytes(dtype):
    torch.manual_seed(0)
    bs, kvh, hd = 4, 2, 8
    kv = allocate_kv_cache(6, 1, bs, kvh, hd, dtype)
    key = quantize_kv(torch.randn(4, kvh, hd), 0.5, dtype)
    value = quantize_kv(torch.randn(4, kvh, hd), 2.0, dtype)
    slots = torch.tensor([5 * bs + 3, 0, 2 * bs + 1, 7])
    reshape_and_cache_triton(key, value, kv[:, 0, 0], kv[:, 0, 1], slots)
    b, o = slots // bs, slots % bs
    assert torch.equal(kv[b, 0, 0, o].view(torch.uint8), key.view(torch.uint8))
    assert torch.equal(kv[b, 0, 1, o].view(torch.uint8), value.view(torch.uint8))


@in_process
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("num_heads,num_kv_heads,window", [(4, 4, None), (6, 2, 6)])
def test_triton_decode_reads_fp8_in_place(dtype, num_heads, num_kv_heads, window, monkeypatch):
    torch.manual_seed(1)
    bs, hd, num_blocks, ks, vs = 4, 16, 40, 0.75, 1.5
    seqs = [(9, 1), (16, 1), (0, 1), (22, 1), (0, 7), (5, 6)]
    kv = allocate_kv_cache(num_blocks, 1, bs, num_kv_heads, hd, torch.float32)
    kv = kv.normal_().to(dtype)  # stale bytes in unused slots
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    meta.attention_backend = AttentionBackend.TRITON_PAGED
    query = torch.randn(meta.num_tokens, num_heads, hd)
    key = torch.randn(meta.num_tokens, num_kv_heads, hd)
    value = torch.randn(meta.num_tokens, num_kv_heads, hd)
    reshape_and_cache_triton(quantize_kv(key, ks, dtype), quantize_kv(value, vs, dtype),
                             *layer, meta.slot_mapping)
    seen = []
    real = kv_quant.paged_attention_fp8

    def spy(*args, **kwargs):
        seen.append(args[-1] is not None)  # the Triton decode kernel was passed
        return real(*args, **kwargs)

    monkeypatch.setattr("tandem.kernels.attention.paged_attention_fp8", spy)
    got = paged_attention(query, key, value, layer, meta, hd**-0.5, window, k_scale=ks,
                          v_scale=vs)
    assert seen == [True]
    kc, vc = dequantize_kv(layer[0], ks, torch.float32), dequantize_kv(layer[1], vs, torch.float32)
    kq = dequantize_kv(quantize_kv(key, ks, dtype), ks, torch.float32)
    vq = dequantize_kv(quantize_kv(value, vs, dtype), vs, torch.float32)
    meta.attention_backend = None
    want = paged_attention_ref(query, kq, vq, kc, vc, meta, hd**-0.5, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
