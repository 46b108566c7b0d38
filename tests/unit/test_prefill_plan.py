"""How a prefill's attention runs off the CPU, and its memory bound (issue 36).

A prefill with a mask (a prefix-cache hit, a later chunk, a sliding window) under GQA,
and every float32 GQA prefill, used to fall back to SDPA's math kernel with the whole
float32 score matrix (~8.6 GB per layer call at a 32k context with 2,048-token chunks)
while the memory profile ran only unmasked prefills. ``plan_prefill_attention`` says
which path a prefill takes and what it may hold; the tiled path runs here on the CPU
through the same code a GPU runs, against a dense float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import attention
from tandem.kernels.attention import build_attention_metadata, paged_attention
from tandem.kernels.attention_backend import (
    PREFILL_SCORE_BUDGET_BYTES,
    AttentionBackend,
    PrefillPath,
    plan_prefill_attention,
)
from tandem.kernels.cache import allocate_kv_cache, reshape_and_cache

# A Llama-3-8B-like layer: 32 query heads on 8 KV heads of 128, bf16.
H, KVH, HD, BF16 = 32, 8, 128, 2


def test_a_masked_gqa_prefill_at_32k_is_tiled_within_the_budget():
    """The issue's case: a 2,048-token chunk at the end of a 32k context. Untiled its
    float32 scores are 8.6 GB; tiled, each call holds at most the budget."""
    whole = H * 2048 * 32768 * 4
    assert whole == 8_589_934_592
    plan = plan_prefill_attention("cuda", H, KVH, HD, BF16, 2048, 32768, masked=True,
                                  flash=True)
    assert plan.path is PrefillPath.TILED
    assert plan.score_bytes <= PREFILL_SCORE_BUDGET_BYTES
    assert plan.query_tile == 64 and plan.num_calls == 32
    assert plan.peak_bytes < 1 << 30
    assert plan.peak_bytes >= 2 * plan.score_bytes


@pytest.mark.parametrize("masked", [False, True])
def test_float32_gqa_prefills_are_tiled(masked):
    """FlashAttention takes no float32: every float32 prefill, masked or not, is tiled."""
    plan = plan_prefill_attention("cuda", H, KVH, HD, 4, 2048, 2048 + 30000 * masked,
                                  masked=masked, flash=False)
    assert plan.path is PrefillPath.TILED
    assert plan.score_bytes <= PREFILL_SCORE_BUDGET_BYTES


def test_an_unmasked_half_prefill_takes_flash_and_holds_no_scores():
    plan = plan_prefill_attention("cuda", H, KVH, HD, BF16, 2048, 2048, masked=False,
                                  flash=True)
    assert (plan.path, plan.num_calls, plan.score_bytes) == (PrefillPath.FLASH_CAUSAL, 1, 0)


def test_a_short_masked_prefill_is_one_call():
    plan = plan_prefill_attention("cuda", H, KVH, HD, BF16, 512, 1024, masked=True, flash=True)
    assert (plan.path, plan.query_tile, plan.num_calls) == (PrefillPath.TILED, 512, 1)
    assert plan.score_bytes == H * 512 * 1024 * 4


def test_the_cpu_keeps_one_sdpa_call():
    plan = plan_prefill_attention("cpu", H, KVH, HD, 4, 2048, 32768, masked=True, flash=False)
    assert (plan.path, plan.num_calls) == (PrefillPath.CPU_SDPA, 1)


def test_a_single_query_row_over_the_budget_still_runs():
    """At least one query per call, even where one row's scores exceed the budget."""
    plan = plan_prefill_attention("cuda", 4, 1, 16, 4, 8, 1000, masked=True, flash=False,
                                  score_budget_bytes=100)
    assert (plan.query_tile, plan.num_calls, plan.score_bytes) == (1, 8, 4 * 1000 * 4)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_heads": 6, "num_kv_heads": 4}, "multiple"),
    ({"num_queries": 0}, "num_queries"),
    ({"num_keys": 3}, "num_keys"),
    ({"score_budget_bytes": 0}, "score_budget_bytes"),
])
def test_bad_shapes_are_refused(kwargs, match):
    args = {"device_type": "cuda", "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "elem_bytes": 4, "num_queries": 8, "num_keys": 8, "masked": True,
            "flash": False, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_prefill_attention(**args)


def _dense(q, k, v, num_computed, window):
    """float64 reference: q [n, H, D] at positions num_computed.., k/v [L, KVH, D]."""
    n, heads, hd = q.shape
    group = heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(hd)
    q_pos = torch.arange(num_computed, num_computed + n)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


@pytest.fixture
def gpu_plan(monkeypatch):
    """Plan every prefill as a GPU without FlashAttention would (float32, or masked),
    with a budget of 2 KiB so that each prefill takes several tiles; record each SDPA
    call's score-matrix size and whether it asked for ``enable_gqa``."""
    budget = 2048
    calls: list[tuple[int, bool]] = []

    def plan(query, num_kv_heads, num_queries, num_keys, masked):
        return plan_prefill_attention("cuda", query.shape[1], num_kv_heads, query.shape[2],
                                      query.element_size(), num_queries, num_keys, masked,
                                      flash=False, score_budget_bytes=budget)

    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[1] * q.shape[2] * k.shape[2] * 4, kwargs.get("enable_gqa", False)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "_prefill_plan", plan)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return budget, calls


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 6])
def test_tiled_prefills_equal_dense_attention(gpu_plan, num_heads, num_kv_heads, window):
    """Prefills with and without a cached prefix, under GQA and a window, beside
    decodes, through the TORCH_SDPA backend (a GPU's reference path) with the GPU's
    plan: dense attention's outputs, every call within the budget, no enable_gqa."""
    budget, calls = gpu_plan
    torch.manual_seed(3)
    bs, hd, num_blocks = 4, 16, 64
    seqs = [(9, 1), (0, 13), (32, 7), (5, 11), (0, 1), (20, 20)]
    kv = allocate_kv_cache(num_blocks, 1, bs, num_kv_heads, hd, torch.float32)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    free = torch.randperm(num_blocks).tolist()
    tables, full_k, full_v = [], [], []
    for c, n in seqs:
        tables.append([free.pop() for _ in range(-(-(c + n) // bs))])
        full_k.append(torch.randn(c + n, num_kv_heads, hd))
        full_v.append(torch.randn(c + n, num_kv_heads, hd))
        if c:
            pos = torch.arange(c)
            slots = torch.tensor(tables[-1])[pos // bs] * bs + pos % bs
            reshape_and_cache(full_k[-1][:c], full_v[-1][:c], layer, slots)
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs)
    meta.attention_backend = AttentionBackend.TORCH_SDPA
    key = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs, strict=True)])
    query = torch.randn(meta.num_tokens, num_heads, hd)
    reshape_and_cache(key, value, layer, meta.slot_mapping)
    out = paged_attention(query, key, value, layer, meta, hd**-0.5, window)
    start = 0
    for (c, n), k, v in zip(seqs, full_k, full_v, strict=True):
        want = _dense(query[start : start + n], k, v, c, window)
        torch.testing.assert_close(out[start : start + n].double(), want, rtol=1e-5, atol=1e-5)
        start += n
    prefill_calls = calls[1:]  # the first call is the decode group's
    assert len(prefill_calls) > len(meta.prefills), "no prefill took several tiles"
    for score_bytes, gqa in prefill_calls:
        assert not gqa
        assert score_bytes <= max(budget, num_heads * (20 + 20) * 4)  # a row over budget


def test_tiled_prefill_ignores_slots_before_the_window(gpu_plan):
    """A chunk after a cached prefix under a sliding window: slots before the first key
    any query sees hold NaN, which must not reach the outputs of any tile."""
    torch.manual_seed(12)
    hd, heads, kvh, bs, window = 16, 4, 2, 4, 8
    c, n = 37, 9
    kv = allocate_kv_cache(16, 1, bs, kvh, hd, torch.float32)
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    table = [3, 1, 6, 0, 9, 12, 2, 5, 8, 10, 11, 13]
    k = torch.randn(c + n, kvh, hd)
    v = torch.randn(c + n, kvh, hd)
    pos = torch.arange(c + n)
    reshape_and_cache(k, v, layer, torch.tensor(table)[pos // bs] * bs + pos % bs)
    for p in range(c - window + 1):
        for t in layer:
            t[table[p // bs], p % bs] = float("nan")
    meta = build_attention_metadata([n], [c], [table], bs)
    q = torch.randn(n, heads, hd)
    out = torch.full_like(q, float("nan"))
    attention._prefill_attention_sdpa(out, q, k[c:], v[c:], *layer, meta, hd**-0.5, window)
    torch.testing.assert_close(out.double(), _dense(q, k, v, c, window), rtol=1e-5, atol=1e-5)
