"""Kernels against independent references: transformers' RMSNorm / RoPE, and a dense
float64 causal attention for the paged attention over block tables."""

from __future__ import annotations

import math

import pytest
import torch
from native_variants import VARIANTS, on_variant
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tandem.kernels import attention as attention_mod
from tandem.kernels import backend, cpu_ext
from tandem.kernels import linear as linear_mod
from tandem.kernels.attention import build_attention_metadata, paged_attention
from tandem.kernels.cache import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    reshape_and_cache,
    reshape_and_cache_ref,
)
from tandem.kernels.layernorm import rms_norm, rms_norm_ref
from tandem.kernels.rotary import (
    RotaryEmbedding,
    compute_inv_freq,
    rotary_embedding,
    rotary_embedding_ref,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 64, dtype=dtype) * 3
    hf = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    hf = hf.to(dtype)
    ours = rms_norm(x, hf.weight.detach(), 1e-5)
    torch.testing.assert_close(ours, hf(x).detach(), rtol=0, atol=0)


def test_rms_norm_fused_residual():
    torch.manual_seed(0)
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    out, new_res = rms_norm(x, w, 1e-6, residual=res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, rms_norm(x + res, w, 1e-6))


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(4), 1e-6)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 100000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=["default", "theta1e5", "linear", "llama3"],
)
def test_rotary_matches_transformers(rope_parameters):
    torch.manual_seed(0)
    head_dim, num_heads, num_kv = 32, 4, 2
    cfg = LlamaConfig(
        hidden_size=head_dim * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv,
        max_position_embeddings=512,
        rope_parameters=rope_parameters,
    )
    hf_rope = LlamaRotaryEmbedding(cfg)
    positions = torch.tensor([0, 1, 5, 17, 300, 511])
    q = torch.randn(len(positions), num_heads, head_dim)
    k = torch.randn(len(positions), num_kv, head_dim)
    cos_hf, sin_hf = hf_rope(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf
    )
    scaling = rope_parameters if rope_parameters["rope_type"] != "default" else None
    rope = RotaryEmbedding(head_dim, 512, rope_parameters["rope_theta"], scaling)
    cos, sin = rope.cos_sin(positions)
    q_ours, k_ours = rotary_embedding(q, k, cos, sin)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_rotary_rejects_unknown_rope_type():
    with pytest.raises(ValueError, match="yarn"):
        compute_inv_freq(32, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_reshape_and_cache_writes_only_its_slots():
    torch.manual_seed(0)
    num_blocks, layers, bs, kvh, hd = 6, 3, 4, 2, 8
    kv = allocate_kv_cache(num_blocks, layers, bs, kvh, hd, torch.float32)
    assert kv.shape == (num_blocks, layers, 2, bs, kvh, hd)
    assert kv_cache_bytes_per_block(layers, bs, kvh, hd, torch.float32) == kv[0].numel() * 4
    slots = torch.tensor([5 * bs + 3, 0, 2 * bs + 1])
    key, value = torch.randn(3, kvh, hd), torch.randn(3, kvh, hd)
    reshape_and_cache(key, value, (kv[:, 1, 0], kv[:, 1, 1]), slots)
    expected = torch.zeros_like(kv)
    for t, (b, o) in enumerate([(5, 3), (0, 0), (2, 1)]):
        expected[b, 1, 0, o] = key[t]
        expected[b, 1, 1, o] = value[t]
    torch.testing.assert_close(kv, expected, rtol=0, atol=0)


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cache_write_matches_reference_on_strided_views(dtype):
    """K/V as the model passes them (views into the fused qkv output) into one
    layer of a multi-layer cache; the native copy equals index_put exactly."""
    torch.manual_seed(9)
    num_blocks, layers, bs, kvh, hd, tokens = 8, 3, 16, 3, 64, 21
    qkv = torch.randn(tokens, (9 + 2 * kvh) * hd).to(dtype)
    key = qkv[:, 9 * hd : (9 + kvh) * hd].view(tokens, kvh, hd)
    value = qkv[:, (9 + kvh) * hd :].view(tokens, kvh, hd)
    slots = torch.randperm(num_blocks * bs)[:tokens]
    ours = allocate_kv_cache(num_blocks, layers, bs, kvh, hd, dtype)
    ref = allocate_kv_cache(num_blocks, layers, bs, kvh, hd, dtype)
    assert cpu_ext.cache_write_cpu(key, value, ours[:, 2, 0], ours[:, 2, 1], slots)
    reshape_and_cache_ref(key, value, ref[:, 2, 0], ref[:, 2, 1], slots // bs, slots % bs)
    assert ref.any()
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_reshape_and_cache_rejects_bad_slot_mapping():
    kv = allocate_kv_cache(2, 1, 4, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache(
            torch.randn(2, 1, 8),
            torch.randn(2, 1, 8),
            (kv[:, 0, 0], kv[:, 0, 1]),
            torch.tensor([0, 1], dtype=torch.int32),
        )


def _attend_and_compare(seqs, full_k, full_v, layer, meta, num_heads: int, hd: int,
                        window) -> None:
    """Write the step's new K/V (``seqs``: (cached, new) per sequence) into ``layer``, run
    ``paged_attention`` on random queries and compare each sequence's rows with dense
    attention over its whole K/V."""
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    query = torch.randn(meta.num_tokens, num_heads, hd)
    reshape_and_cache(key, value, layer, meta.slot_mapping)
    out = paged_attention(query, key, value, layer, meta, hd**-0.5, window)
    start = 0
    for (c, n), k, v in zip(seqs, full_k, full_v, strict=True):
        ref = _dense_attention(query[start : start + n], k, v, c, window)
        torch.testing.assert_close(out[start : start + n].double(), ref, rtol=1e-5, atol=1e-5)
        start += n


def _dense_attention(q, k, v, num_computed, window=None):
    """float64 reference: q [n, H, D] at positions num_computed.., k/v [L, KVH, D]."""
    n, num_heads, hd = q.shape
    group = num_heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(hd)
    q_pos = torch.arange(num_computed, num_computed + n)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (num_computed, num_new) per sequence: decodes, a fresh prompt, prefix-cached
# prompts and later chunks, a 1-token prompt, in a deliberately mixed order.
MIXED_BATCH = [(9, 1), (0, 13), (16, 1), (32, 7), (0, 1), (5, 11), (47, 1), (3, 1)]


@pytest.fixture(params=["torch", *VARIANTS])
def cpu_attention_path(request, monkeypatch):
    """Run a test on the torch reference and on the native CPU decode kernel of
    each ISA variant this CPU can execute.

    The native path is checked to be the one taken (a spy counts its calls)."""
    calls = []
    if request.param == "torch":
        monkeypatch.setattr(cpu_ext, "supports", lambda q, k: False)
        yield request.param
        assert not calls
        return
    real = cpu_ext.paged_decode_attention_cpu

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_ext, "paged_decode_attention_cpu", spy)
    with on_variant(request.param):
        yield request.param
    assert calls


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("decodes_first", [True, False])
def test_paged_attention_matches_dense(
    num_heads, num_kv_heads, window, decodes_first, cpu_attention_path
):
    torch.manual_seed(1)
    bs, hd, num_blocks = 4, 16, 64
    seqs = sorted(MIXED_BATCH, key=lambda s: s[1] != 1) if decodes_first else MIXED_BATCH
    kv = allocate_kv_cache(num_blocks, 2, bs, num_kv_heads, hd, torch.float32)
    layer = (kv[:, 1, 0], kv[:, 1, 1])
    # Scattered, shuffled block ids so that block order != physical order.
    free = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v = [], [], []
    for c, n in seqs:
        nb = -(-(c + n) // bs)
        tables.append([free.pop() for _ in range(nb)])
        full_k.append(torch.randn(c + n, num_kv_heads, hd))
        full_v.append(torch.randn(c + n, num_kv_heads, hd))
        # Cached prefix: written the way an earlier step would have.
        if c:
            pos = torch.arange(c)
            slots = torch.tensor(tables[-1])[pos // bs] * bs + pos % bs
            reshape_and_cache(full_k[-1][:c], full_v[-1][:c], layer, slots)
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    _attend_and_compare(seqs, full_k, full_v, layer, meta, num_heads, hd, window)
    expected_positions = [p for c, n in seqs for p in range(c, c + n)]
    assert meta.positions.tolist() == expected_positions
    assert meta.num_decodes == sum(1 for _, n in seqs if n == 1)
    assert (meta.decode_token_idx is None) == decodes_first


def test_paged_attention_bfloat16_close_to_dense(cpu_attention_path):
    torch.manual_seed(2)
    bs, hd, kvh, heads = 16, 64, 3, 9
    seqs = [(40, 1), (0, 37), (20, 20)]
    kv = allocate_kv_cache(16, 1, bs, kvh, hd, torch.bfloat16)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    full_k = [torch.randn(c + n, kvh, hd, dtype=torch.bfloat16) for c, n in seqs]
    full_v = [torch.randn(c + n, kvh, hd, dtype=torch.bfloat16) for c, n in seqs]
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    for (c, _), t, k, v in zip(seqs, tables, full_k, full_v, strict=True):
        if c:
            pos = torch.arange(c)
            reshape_and_cache(k[:c], v[:c], layer, torch.tensor(t)[pos // bs] * bs + pos % bs)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    query = torch.randn(meta.num_tokens, heads, hd, dtype=torch.bfloat16)
    reshape_and_cache(key, value, layer, meta.slot_mapping)
    out = paged_attention(query, key, value, layer, meta, hd**-0.5)
    assert out.dtype == torch.bfloat16
    start = 0
    for (c, n), k, v in zip(seqs, full_k, full_v, strict=True):
        ref = _dense_attention(query[start : start + n], k, v, c)
        torch.testing.assert_close(out[start : start + n].double(), ref, rtol=0, atol=3e-2)
        start += n


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize(
    "dtype,tiles",
    [(torch.float32, None), (torch.bfloat16, False), (torch.bfloat16, None)],
    ids=["fp32", "bf16-avx512", "bf16-tiles"],
)
@pytest.mark.parametrize(
    "head_dim,num_heads,num_kv_heads",
    [(64, 9, 3), (128, 8, 2), (32, 4, 4), (96, 12, 2), (64, 32, 2), (64, 16, 16)],
)
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("bs", [16, 32, 8])
def test_native_decode_kernel_matches_reference(
    dtype, tiles, head_dim, num_heads, num_kv_heads, window, bs
):
    """The native kernel against the gather + SDPA reference on a strided layer
    view (block stride spans all layers), shuffled blocks, lengths from 1 token
    to several blocks, partial last blocks; block sizes that take the
    16-row VDPBF16PS / AMX paths (16, 32) and one that cannot (8); query-head
    groups of 1, 3, 4, 6 and 16 (one or several KV heads per 16-column score
    tile), head dims 32-128."""
    torch.manual_seed(3)
    num_blocks, num_layers = 96 * 16 // bs, 3
    kv = torch.randn(num_blocks, num_layers, 2, bs, num_kv_heads, head_dim).to(dtype)
    layer = (kv[:, 2, 0], kv[:, 2, 1])
    lens = [1, 15, 16, 17, 40, 100, 161]
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    meta = build_attention_metadata([1] * len(lens), [n - 1 for n in lens], tables, bs)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype)
    assert cpu_ext.supports(q, layer[0])
    scale = head_dim**-0.5
    ref = attention_mod._decode_attention_sdpa(
        q.float(), *(t.float() for t in layer), meta, scale, window
    )
    # Rows a sequence must not see (past its length, before its window) may hold
    # anything, e.g. a block pulled from another instance: NaN must not leak in.
    for n, table in zip(lens, tables, strict=True):
        lo = max(0, n - window) if window else 0
        for p in [*range(lo), *range(n, len(table) * bs)]:
            for t in layer:
                t[table[p // bs], p % bs] = float("nan")
    out = cpu_ext.paged_decode_attention_cpu(
        q, *layer, meta.decode_block_tables, meta.decode_seq_lens, scale, window, tiles=tiles
    )
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("window", [None, 6])
def test_batch_invariant_metadata_makes_every_token_a_decode_row(window, cpu_attention_path):
    """``batch_invariant=True`` (ModelConfig.deterministic): the mixed batch's tokens,
    prompts and chunks included, all become decode rows at their own positions with
    their sequence's table; the attention still matches the dense reference."""
    torch.manual_seed(1)
    bs, hd, num_heads, num_kv_heads = 4, 16, 6, 2
    kv = allocate_kv_cache(64, 1, bs, num_kv_heads, hd, torch.float32)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    free = torch.randperm(64).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in MIXED_BATCH]
    full_k = [torch.randn(c + n, num_kv_heads, hd) for c, n in MIXED_BATCH]
    full_v = [torch.randn(c + n, num_kv_heads, hd) for c, n in MIXED_BATCH]
    lens, done = [n for _, n in MIXED_BATCH], [c for c, _ in MIXED_BATCH]
    plain = build_attention_metadata(lens, done, tables, bs)
    meta = build_attention_metadata(lens, done, tables, bs, batch_invariant=True)
    assert meta.prefills == [] and meta.num_decodes == meta.num_tokens == plain.num_tokens
    assert meta.decode_token_idx is None
    assert meta.positions.tolist() == plain.positions.tolist()
    assert meta.slot_mapping.tolist() == plain.slot_mapping.tolist()
    assert meta.decode_seq_lens is not None and meta.decode_block_tables is not None
    assert meta.decode_seq_lens.tolist() == [p + 1 for p in plain.positions.tolist()]
    for i, (c, _) in enumerate(MIXED_BATCH):  # written as earlier steps would have
        pos = torch.arange(c)
        reshape_and_cache(full_k[i][:c], full_v[i][:c], layer,
                          torch.tensor(tables[i])[pos // bs] * bs + pos % bs)
    _attend_and_compare(MIXED_BATCH, full_k, full_v, layer, meta, num_heads, hd, window)


@pytest.mark.usefixtures("native_variant")
def test_batch_invariant_attention_rows_do_not_depend_on_chunks_or_batch():
    """bf16 on the native decode kernel: one 37-token sequence's attention outputs are
    bit-identical whether its tokens come in one step, in chunks (after a cached
    prefix) or batched with other sequences."""
    torch.manual_seed(5)
    bs, hd, heads, kvh, n = 16, 64, 8, 2, 37
    kv = allocate_kv_cache(16, 1, bs, kvh, hd, torch.bfloat16)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    table, other = [7, 2, 11], [3, 5, 9, 1]
    k = torch.randn(n, kvh, hd, dtype=torch.bfloat16)
    v = torch.randn(n, kvh, hd, dtype=torch.bfloat16)
    q = torch.randn(n, heads, hd, dtype=torch.bfloat16)
    pos = torch.arange(n)
    reshape_and_cache(k, v, layer, torch.tensor(table)[pos // bs] * bs + pos % bs)
    ok, ov = torch.randn(60, kvh, hd).bfloat16(), torch.randn(60, kvh, hd).bfloat16()
    pos = torch.arange(60)
    reshape_and_cache(ok, ov, layer, torch.tensor(other)[pos // bs] * bs + pos % bs)

    def attend(steps):
        """``steps``: per step, (sequence, first token, count); the other sequence is
        the 60-token one. Returns the 37-token sequence's rows, in order."""
        rows = []
        for step in steps:
            lens = [cnt for _, _, cnt in step]
            done = [first for _, first, _ in step]
            tabs = [table if name == "seq" else other for name, _, _ in step]
            meta = build_attention_metadata(lens, done, tabs, bs, batch_invariant=True)
            qs = torch.cat([q[f : f + c] if name == "seq" else torch.randn(c, heads, hd).bfloat16()
                            for name, f, c in step])
            ks = torch.cat([(k if name == "seq" else ok)[f : f + c] for name, f, c in step])
            vs = torch.cat([(v if name == "seq" else ov)[f : f + c] for name, f, c in step])
            out = paged_attention(qs, ks, vs, layer, meta, hd**-0.5)
            start = 0
            for name, _, cnt in step:
                if name == "seq":
                    rows.append(out[start : start + cnt])
                start += cnt
        return torch.cat(rows)

    whole = attend([[("seq", 0, n)]])
    chunked = attend([[("seq", 0, 16)], [("seq", 16, 5)], [("seq", 21, 16)]])
    batched = attend([[("other", 59, 1), ("seq", 0, n), ("other", 10, 30)]])
    one_by_one = attend([[("seq", i, 1)] for i in range(n)])
    for got in (chunked, batched, one_by_one):
        assert torch.equal(got, whole)


@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (1536, 576)])
def test_batch_invariant_packed_linear_rows_do_not_depend_on_the_batch(in_features, out_features):
    """``batch_invariant=True``: every batch size on the packed kernel (the default
    hands 112 rows and more to oneDNN), so a row's outputs, its greedy argmax and its
    SwiGLU are bit-identical at 1-9, 17, 30, 111, 112 and 300 rows (shapes of the default
    model, where oneDNN's result changes with the batch on AMX CPUs)."""
    if cpu_ext.bf16_linear_path() == cpu_ext.LINEAR_NONE:
        pytest.skip("no packed bf16 linear kernel on this machine")
    torch.manual_seed(6)
    lin = torch.nn.Linear(in_features, out_features).to(torch.bfloat16)
    layer = linear_mod.replace_cpu_bf16_linear(lin, batch_invariant=True)
    default = linear_mod.replace_cpu_bf16_linear(lin)
    model = torch.nn.ModuleDict({"inv": layer, "default": default})
    assert layer.vnni_weight is not None and layer.MAX_PACKED_ROWS is None
    expected = ["default"] if default.MAX_PACKED_ROWS is not None else []
    assert linear_mod.batch_variant_layers(model) == expected
    x = torch.randn(300, in_features).bfloat16()
    full, ids, act = layer(x), layer.forward_argmax(x), layer.forward_swiglu(x)
    assert ids is not None
    for m in (1, 2, 3, 5, 9, 17, 30, 111, 112):
        assert torch.equal(layer(x[:m]), full[:m])
        assert torch.equal(layer(x[-m:]), full[-m:])
        got = layer.forward_argmax(x[-m:])
        assert got is not None and torch.equal(got, ids[-m:])
        if act is not None:
            small = layer.forward_swiglu(x[-m:])
            assert small is not None and torch.equal(small, act[-m:])


def test_native_kernel_declines_unsupported_shapes():
    q = torch.randn(2, 4, 8)  # head_dim 8: not a multiple of the vector width
    cache = torch.zeros(4, 16, 4, 8)
    assert not cpu_ext.supports(q, cache)
    assert not cpu_ext.supports(q.half(), cache.half())


def test_native_kernel_build_failure_falls_back(tmp_path):
    """A compiler that fails leaves load() at None, every op on the torch backend."""
    config = backend.KernelConfig(cache_dir=tmp_path, compiler="false")
    failing = backend.KernelBackends(config, backend.Platform.detect())
    with backend.selected(failing):
        assert cpu_ext.load() is None
        assert failing.for_tensor(torch.zeros(1)) is backend.KernelBackend.TORCH
        assert cpu_ext.silu_and_mul_cpu(torch.zeros(2, 4).bfloat16()) is None
    assert not list(tmp_path.glob("*"))


def test_build_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match="block table"):
        build_attention_metadata([5], [12], [[0, 1, 2, 3]], 4)


def test_paged_attention_rejects_mismatched_heads():
    kv = allocate_kv_cache(2, 1, 4, 2, 8, torch.float32)
    meta = build_attention_metadata([2], [0], [[0]], 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_attention(
            torch.randn(2, 3, 8),
            torch.randn(2, 2, 8),
            torch.randn(2, 2, 8),
            (kv[:, 0, 0], kv[:, 0, 1]),
            meta,
            1.0,
        )


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 17, 33, 64, 111, 112, 300])
@pytest.mark.parametrize("in_features", [96, 100])  # 100: no VNNI tiling (K % 32)
def test_packed_linear_equals_f_linear_bf16(bias, tokens, in_features):
    """Large batches (or no VNNI packing) run F.linear itself; our packed kernel
    (fewer than PACKED_MAX_ROWS rows, where the CPU has AVX512-BF16) sums in
    float32 in another order and rounds once, so it is checked against the
    float32 product: within one bf16 rounding."""
    torch.manual_seed(4)
    lin = torch.nn.Linear(in_features, 160, bias=bias).to(torch.bfloat16)
    x = torch.randn(tokens, in_features, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    packed = linear_mod.PackedLinear(lin)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 160)
    uses_packed = packed.vnni_weight is not None and tokens < linear_mod.PACKED_MAX_ROWS
    assert (packed.vnni_weight is not None) == cpu_ext.bf16_linear_supports(160, in_features)
    if not uses_packed:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        return
    exact = torch.nn.functional.linear(x.float(), lin.weight.float())
    if bias:
        exact = exact + lin.bias.float()
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-3)
    assert (out == exact.bfloat16()).float().mean() > 0.95


# The AVX512-BF16 kernels on each variant that has them (conftest's bf16_variant);
# tests taking ``tiles`` run them with VDPBF16PS and on AMX tiles.
_BF16_LINEAR = pytest.mark.usefixtures("bf16_variant")


@_BF16_LINEAR
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 17, 64, 111])
def test_packed_swiglu_is_bit_identical_to_linear_then_silu(bias, tokens):
    """The fused gate/up + SwiGLU pass (the MLP's decode path) rounds exactly
    as the two kernels it replaces; beyond PACKED_MAX_ROWS it declines."""
    torch.manual_seed(10)
    lin = torch.nn.Linear(96, 2 * 80, bias=bias).to(torch.bfloat16)
    packed = linear_mod.PackedLinear(lin)
    x = torch.randn(tokens, 96, dtype=torch.bfloat16)
    fused = packed.forward_swiglu(x)
    assert fused is not None and fused.shape == (tokens, 80)
    torch.testing.assert_close(fused, cpu_ext.silu_and_mul_cpu(packed(x)), rtol=0, atol=0)
    assert packed.forward_swiglu(torch.randn(linear_mod.PACKED_MAX_ROWS, 96).bfloat16()) is None


@pytest.mark.parametrize("tokens", [1, 3, 8, 21, 40, 70])  # partial row blocks of each path
@pytest.mark.parametrize("out_features", [48, 64])  # an odd and an even number of column blocks
def test_bf16_linear_strided_rows_and_rejects_bad_shapes(linear_tiles, tokens, out_features):
    """Every path (AMX tiles, VDPBF16PS, float32 FMAs) against the float32 product,
    within one bf16 rounding; the SwiGLU epilogue (AVX512-BF16 only) bit-identical to
    the linear then SiLU-and-mul, and refused on the FMA path."""
    tiles = linear_tiles
    torch.manual_seed(8)
    w = torch.randn(out_features, 64).bfloat16()
    b = torch.randn(out_features).bfloat16()
    packed = cpu_ext.bf16_pack_weight(w)
    base = torch.randn(tokens, 128).bfloat16()
    x = base[:, 32:96]  # row stride 128, as a slice of a fused projection
    out = cpu_ext.bf16_linear(x, packed, b, out_features, tiles=tiles)
    exact = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-3)
    if out_features % 32 == 0 and cpu_ext.bf16_linear_available():
        fused = cpu_ext.bf16_linear_swiglu(x, packed, b, out_features, tiles=tiles)
        torch.testing.assert_close(fused, cpu_ext.silu_and_mul_cpu(out), rtol=0, atol=0)
    elif out_features % 32 == 0:
        with pytest.raises(RuntimeError, match="bf16_linear_swiglu failed"):
            cpu_ext.bf16_linear_swiglu(x, packed, b, out_features, tiles=tiles)
    with pytest.raises(ValueError, match="bf16 packing"):
        cpu_ext.bf16_pack_weight(torch.randn(48, 40).bfloat16())
    with pytest.raises(ValueError, match="bf16 packing"):
        cpu_ext.bf16_pack_weight(torch.randn(48, 64))


def test_pack_linear_layers_only_touches_bf16_cpu_linears():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8).to(torch.bfloat16),
        torch.nn.Linear(8, 8),  # float32: left alone
        torch.nn.Embedding(4, 8).to(torch.bfloat16),
    )
    assert linear_mod.pack_linear_layers(model) == 1
    assert linear_mod.pack_linear_layers(model) == 0  # idempotent
    expected = (
        linear_mod.PackedLinear
        if linear_mod.fast_bf16_gemm()
        else linear_mod.Float32ComputeLinear
    )
    assert type(model[0]) is expected
    assert type(model[1]) is torch.nn.Linear
    for cls in (linear_mod.PackedLinear, linear_mod.Float32ComputeLinear):
        with pytest.raises(ValueError, match="bf16 CPU weight"):
            cls(torch.nn.Linear(4, 4))


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 37, 111, 112, 200])
def test_float32_compute_linear_is_the_rounded_float32_product(bias, tokens):
    """A bf16 layer computed in float32: where the variant's linear path is
    LINEAR_FMA, our FMA kernel at every batch size (another summation order: within
    one bf16 rounding of the float32 product) and no float32 weight kept; otherwise
    the float32 product of the (exactly widened) bf16 operands rounded to bf16 once.
    Both close to PyTorch's bf16 GEMM; the fused argmax picks what argmax over the
    outputs picks, and there is no fused SwiGLU."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(96, 48, bias=bias).to(torch.bfloat16)
    x = torch.randn(tokens, 96, dtype=torch.bfloat16)
    layer = linear_mod.Float32ComputeLinear(lin)
    fma = cpu_ext.bf16_linear_path() == cpu_ext.LINEAR_FMA
    assert (layer.vnni_weight is not None) == fma
    assert (layer.weight32 is None) == fma
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 48)
    b = lin.bias.float() if bias else None
    exact = torch.nn.functional.linear(x.float(), lin.weight.float(), b)
    if fma:
        torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-3)
        assert (out == exact.bfloat16()).float().mean() > 0.95
        assert layer.forward_argmax(x).tolist() == out.max(dim=-1).indices.tolist()
    else:
        assert torch.equal(out, exact.bfloat16())
        assert layer.forward_argmax(x) is None
    torch.testing.assert_close(out, lin(x), rtol=2**-7, atol=1e-2)
    assert layer(x.reshape(1, tokens, 96)).shape == (1, tokens, 48)
    assert layer.forward_swiglu(x) is None
    # an empty batch and a strided x (every other column of a wider tensor), as nn.Linear
    assert layer(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 48)
    wide = torch.zeros(tokens, 192, dtype=torch.bfloat16)
    wide[:, ::2] = x
    assert torch.equal(layer(wide[:, ::2]), out)



@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])  # 48: a partial last vector
def test_native_rotary_is_bit_identical_to_reference(dtype, head_dim):
    torch.manual_seed(5)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, dtype=dtype)
    qkv = torch.randn(37, (9 + 2 * 3) * head_dim).to(dtype) * 4
    q = qkv[:, : 9 * head_dim].view(37, 9, head_dim)  # strided views, as the model passes them
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(37, 3, head_dim)
    cos, sin = rope.cos_sin(torch.randint(0, 512, (37,)))
    for x in (q, k):
        out = cpu_ext.rotary_neox_cpu(x, cos, sin)
        assert out is not None
        torch.testing.assert_close(out, rotary_embedding_ref(x, cos, sin), rtol=0, atol=0)


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [576, 200])  # 200: a partial last vector
def test_native_add_rms_norm_matches_reference_bf16(with_residual, hidden):
    torch.manual_seed(6)
    x = (torch.randn(33, hidden) * 3).bfloat16()
    res = torch.randn(33, hidden).bfloat16() if with_residual else None
    w = torch.randn(hidden).bfloat16()
    got = cpu_ext.add_rms_norm_cpu(x, w, 1e-5, res)
    assert got is not None
    if with_residual:
        normed, new_res = got
        torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
        ref = rms_norm_ref(x + res, w, 1e-5)
    else:
        normed, ref = got, rms_norm_ref(x, w, 1e-5)
    # Only the float32 sum of squares runs in another order: one bf16 ulp at most.
    torch.testing.assert_close(normed.float(), ref.float(), rtol=2**-7, atol=1e-6)
    assert (normed == ref).float().mean() > 0.99
    assert cpu_ext.add_rms_norm_cpu(x.float(), w.float(), 1e-5) is None  # fp32: torch path


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("inter", [1536, 100])  # 100: a partial last vector
def test_native_silu_and_mul_matches_reference_bf16(inter):
    torch.manual_seed(7)
    x = (torch.randn(19, 2 * inter) * 4).bfloat16()
    out = cpu_ext.silu_and_mul_cpu(x)
    assert out is not None and out.shape == (19, inter)
    gate, up = x.split(inter, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    # expf's last bit may move silu across a bf16 rounding boundary, and the
    # product then by up to two bf16 ulps; almost every element is identical.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=1e-6)
    assert (out == ref).float().mean() > 0.99
    assert cpu_ext.silu_and_mul_cpu(x.float()) is None


@pytest.mark.usefixtures("native_variant")
def test_native_silu_and_mul_edge_values_bf16():
    """Gates far in the tails: -0 where e^-x overflows (torch: x / inf), NaN for
    NaN and -inf, +inf for +inf (a clamped exponential once gave x * 2^-127)."""
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor(
        [-inf, -3.38e38, -1e36, -100.0, -88.5, -87.0, -20.0, -1.0, -0.0, 0.0, 1e-3, 1.0,
         20.0, 100.0, 3.38e38, inf, nan]
    ).bfloat16()  # fmt: skip
    x = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    out = cpu_ext.silu_and_mul_cpu(x)
    assert out is not None
    ref = torch.nn.functional.silu(gate.float()).bfloat16()
    torch.testing.assert_close(out[0].float(), ref.float(), rtol=2**-7, atol=0, equal_nan=True)


@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [49152, 100, 1])  # 100: a partial last vector
def test_native_argmax_rows_matches_torch_max_indices(dtype, cols):
    """First maximal index on ties, the first NaN where a row has one, strided
    rows; the same indices as ``max(dim=-1).indices``."""
    torch.manual_seed(3)
    base = torch.randn(9, cols + 7).to(dtype)
    x = base[:, 3 : 3 + cols]  # row stride != cols
    if cols > 1:
        x[1] = 0.0  # all tied: index 0
        x[2, [cols - 1, cols // 2]] = 50.0  # tie between two maxima
        x[3, -1] = 50.0  # maximum in the (partial) last vector
        x[4, [cols // 3, cols - 1]] = float("nan")  # first NaN wins
        x[5] = float("-inf")
        x[6, cols // 2] = float("inf")
    out = cpu_ext.argmax_rows_cpu(x)
    assert out is not None and out.dtype == torch.int64
    assert out.tolist() == x.max(dim=-1).indices.tolist()
    assert cpu_ext.argmax_rows_cpu(x.t()) is None  # non-unit column stride: torch path


_PREFILL_BF16 = pytest.mark.usefixtures("bf16_variant")


@_PREFILL_BF16
@pytest.mark.parametrize(
    "head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 8, 2), (32, 4, 4), (96, 6, 1)]
)
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("bs", [16, 8, 32])
def test_prefill_attention_matches_dense(head_dim, num_heads, num_kv_heads, window, bs, tiles):
    """Fresh prompts, prefix-cached prompts and later chunks (num_computed > 0),
    lengths off the 16-row and 32-key tile grid, beside decode tokens, in one
    call, on AMX tiles and with AVX512-BF16 dot products; blocks the sequences do
    not own and the slots past each sequence's end hold NaN, and rows of decode
    tokens must stay untouched."""
    torch.manual_seed(11)
    layers = 2  # the kernel reads a strided layer view
    seqs = [(0, 37), (9, 1), (20, 20), (0, 300), (33, 16), (5, 17)]
    blocks_per = [-(-(c + n) // bs) + 1 for c, n in seqs]  # one spare block each
    kv = allocate_kv_cache(sum(blocks_per) + 3, layers, bs, num_kv_heads, head_dim, torch.bfloat16)
    kv.fill_(float("nan"))
    layer = (kv[:, 1, 0], kv[:, 1, 1])
    ids = torch.randperm(kv.shape[0]).tolist()  # scattered blocks
    tables, at = [], 0
    for nb in blocks_per:
        tables.append(ids[at : at + nb])
        at += nb
    full_k = [torch.randn(c + n, num_kv_heads, head_dim).bfloat16() for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim).bfloat16() for c, n in seqs]
    for t, k, v in zip(tables, full_k, full_v, strict=True):
        pos = torch.arange(k.shape[0])
        reshape_and_cache(k, v, layer, torch.tensor(t)[pos // bs] * bs + pos % bs)
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    query = (torch.randn(meta.num_tokens, num_heads, head_dim) * 2).bfloat16()
    out = torch.full_like(query, float("nan"))
    assert cpu_ext.prefill_attention_supports(query, *layer)
    desc, flat = meta.prefill_descriptors()
    scale = head_dim**-0.5
    cpu_ext.prefill_attention_cpu(query, *layer, desc, flat, scale, window, out, tiles=tiles)
    start = 0
    for (c, n), k, v in zip(seqs, full_k, full_v, strict=True):
        got = out[start : start + n]
        if n == 1:
            assert got.isnan().all(), "a decode row was written by the prefill kernel"
        else:
            ref = _dense_attention(query[start : start + n], k, v, c, window)
            torch.testing.assert_close(got.double(), ref, rtol=0, atol=3e-2)
        start += n


@_PREFILL_BF16
def test_cpu_paged_attention_takes_the_native_prefill_path(monkeypatch):
    """bf16 prefills go to the native kernel (one call for all of them); float32 ones
    stay on SDPA (the token-for-token float32 path)."""
    calls = []
    real = cpu_ext.prefill_attention_cpu
    monkeypatch.setattr(cpu_ext, "prefill_attention_cpu", lambda *a: calls.append(1) or real(*a))
    bs, hd, kvh, heads = 16, 64, 3, 9
    meta = build_attention_metadata([20, 1, 33], [0, 5, 0], [[0, 1], [2], [3, 4, 5]], bs)
    for dtype, expected in ((torch.bfloat16, 1), (torch.float32, 0)):
        calls.clear()
        kv = allocate_kv_cache(8, 1, bs, kvh, hd, dtype)
        layer = (kv[:, 0, 0], kv[:, 0, 1])
        key = torch.randn(meta.num_tokens, kvh, hd, dtype=dtype)
        value = torch.randn(meta.num_tokens, kvh, hd, dtype=dtype)
        reshape_and_cache(key, value, layer, meta.slot_mapping)
        query = torch.randn(meta.num_tokens, heads, hd, dtype=dtype)
        attention_mod.paged_attention_cpu(query, key, value, *layer, meta, hd**-0.5)
        assert len(calls) == expected


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 17, 64, 111])
@pytest.mark.parametrize("out_features", [4112, 48])  # 4112: an odd number of column blocks
def test_bf16_linear_argmax_equals_argmax_of_the_outputs(bias, tokens, out_features, linear_tiles):
    """The fused head + greedy pass picks exactly what argmax over the bf16 outputs
    of ``bf16_linear`` picks (on either path): exact ties (duplicated weight rows, also across the
    two threads' column ranges) go to the first column, a NaN output wins at its
    first column."""
    tiles = linear_tiles
    torch.manual_seed(5)
    w = (torch.randn(out_features, 64) * 0.3).bfloat16()
    w[out_features - 7] = w[3]  # tie between the first and the last column range
    w[out_features // 2 + 1] = w[out_features // 2]
    b = (torch.randn(out_features) * 0.1).bfloat16() if bias else None
    x = torch.randn(tokens, 64).bfloat16()
    x[0] = 0.0  # every output equals its bias: many ties
    packed = cpu_ext.bf16_pack_weight(w)
    full = cpu_ext.bf16_linear(x, packed, b, out_features, tiles=tiles)
    ids = cpu_ext.bf16_linear_argmax(x, packed, b, out_features, tiles=tiles)
    assert ids.tolist() == full.max(dim=-1).indices.tolist()
    if tokens > 1:
        w[out_features - 5, 0] = float("nan")
        w[11, 1] = float("nan")
        packed = cpu_ext.bf16_pack_weight(w)
        ids = cpu_ext.bf16_linear_argmax(x, packed, b, out_features, tiles=tiles)
        full = cpu_ext.bf16_linear(x, packed, b, out_features, tiles=tiles)
        assert ids.tolist() == full.max(dim=-1).indices.tolist()


@_PREFILL_BF16
def test_native_prefill_declines_views_it_cannot_read():
    """A value view strided in the head dim, or key rows at odd element strides
    (read as 32-bit pairs), go to SDPA instead, with the same results."""
    torch.manual_seed(4)
    bs, hd, kvh, heads = 16, 64, 2, 4
    meta = build_attention_metadata([20, 33], [0, 0], [[0, 1], [2, 3, 4]], bs)
    query = torch.randn(meta.num_tokens, heads, hd).bfloat16()
    key = torch.randn(meta.num_tokens, kvh, hd).bfloat16()
    value = torch.randn(meta.num_tokens, kvh, hd).bfloat16()
    kv = allocate_kv_cache(8, 1, bs, kvh, hd, torch.bfloat16)
    good = (kv[:, 0, 0], kv[:, 0, 1])
    strided_v = torch.zeros(8, bs, kvh, 2 * hd).bfloat16()[..., ::2]
    odd_k = torch.zeros(8, bs, kvh * hd + 1).bfloat16()[..., 1:].view(8, bs, kvh, hd)
    assert cpu_ext.prefill_attention_supports(query, *good)
    assert not cpu_ext.prefill_attention_supports(query, good[0], strided_v)
    assert not cpu_ext.prefill_attention_supports(query, odd_k, good[1])
    want = None
    for layer in (good, (good[0], strided_v), (odd_k, good[1])):
        reshape_and_cache(key, value, layer, meta.slot_mapping)
        out = attention_mod.paged_attention_cpu(query, key, value, *layer, meta, hd**-0.5)
        if want is None:
            want = out
        torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2)


def test_prefill_ignores_slots_before_the_window_sdpa():
    """See ``_prefill_ignores_slots_before_the_window``."""
    _prefill_ignores_slots_before_the_window(None)


def test_prefill_ignores_slots_before_the_window_native(tiles):
    """See ``_prefill_ignores_slots_before_the_window``."""
    _prefill_ignores_slots_before_the_window(tiles)


def _prefill_ignores_slots_before_the_window(tiles):
    """A chunk after a cached prefix under a sliding window: cache slots before the
    first key any new query sees may hold anything (as the decode kernel allows);
    NaN there must not reach the outputs (it did: P = 0 times a NaN value)."""
    torch.manual_seed(12)
    hd, heads, kvh, bs, window = 64, 4, 2, 16, 8
    c, n = 37, 5  # queries at 37..41: the first key any of them sees is 30
    kv = allocate_kv_cache(8, 1, bs, kvh, hd, torch.bfloat16)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    table = [3, 1, 6]
    k = torch.randn(c + n, kvh, hd).bfloat16()
    v = torch.randn(c + n, kvh, hd).bfloat16()
    pos = torch.arange(c + n)
    reshape_and_cache(k, v, layer, torch.tensor(table)[pos // bs] * bs + pos % bs)
    for p in range(c - window + 1):
        for t in layer:
            t[table[p // bs], p % bs] = float("nan")
    meta = build_attention_metadata([n], [c], [table], bs)
    q = torch.randn(n, heads, hd).bfloat16()
    out = torch.full_like(q, float("nan"))
    if tiles is None:
        attention_mod._prefill_attention_sdpa(out, q, k[c:], v[c:], *layer, meta, hd**-0.5, window)
    else:
        desc, flat = meta.prefill_descriptors()
        cpu_ext.prefill_attention_cpu(
            q, *layer, desc, flat, hd**-0.5, window, out, tiles=tiles
        )
    ref = _dense_attention(q, k, v, c, window)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)


def test_bf16_linear_reads_a_packed_weight_at_any_offset(linear_tiles):
    """A packed weight viewed at an offset that is not 64-byte aligned (a slice of a
    larger buffer) gives the same result as the aligned one (the VDPBF16PS path used
    aligned loads and crashed)."""
    tiles = linear_tiles
    torch.manual_seed(13)
    w = torch.randn(64, 96).bfloat16()
    x = torch.randn(19, 96).bfloat16()
    packed = cpu_ext.bf16_pack_weight(w)
    want = cpu_ext.bf16_linear(x, packed, None, 64, tiles=tiles)
    for offset in (1, 8, 16):
        buf = torch.empty(packed.numel() + offset, dtype=torch.bfloat16)
        view = buf[offset:]
        view.copy_(packed)
        assert view.data_ptr() % 64 != 0
        got = cpu_ext.bf16_linear(x, view, None, 64, tiles=tiles)
        assert torch.equal(got, want)


@_BF16_LINEAR
def test_bf16_linear_rejects_bad_arguments_and_packed_linear_takes_empty_batches():
    """Wrong dtypes or sizes are a ValueError naming the argument (a float32 x was
    read as bf16 bits); a PackedLinear returns an empty batch for zero rows, as
    nn.Linear does (it raised)."""
    torch.manual_seed(14)
    w = torch.randn(32, 64).bfloat16()
    packed = cpu_ext.bf16_pack_weight(w)
    x = torch.randn(5, 64).bfloat16()
    with pytest.raises(ValueError, match="x must be"):
        cpu_ext.bf16_linear(x.float(), packed, None, 32)
    with pytest.raises(ValueError, match="packed holds"):
        cpu_ext.bf16_linear(x, packed, None, 48)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_ext.bf16_linear(x, packed, torch.zeros(32), 32)
    with pytest.raises(ValueError, match="at least one row"):
        cpu_ext.bf16_linear_argmax(x[:0], packed, None, 32)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    layer = linear_mod.PackedLinear(lin)
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert layer.forward_swiglu(torch.empty(0, 64, dtype=torch.bfloat16)) is None
