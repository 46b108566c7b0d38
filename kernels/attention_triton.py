"""The Triton paged decode attention kernel: one program per (sequence, KV head) reads
its sequence's blocks straight from the paged cache (no gather), the query heads of the
group together, with an online softmax (FlashAttention's running max and sum; Dao et al.
2022, arXiv:2205.14135). ``kernels/attention.py`` dispatches to it on CUDA."""

from __future__ import annotations

import functools
from typing import Any

import torch

_NO_WINDOW = 2**31 - 1


@functools.cache
def _decode_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        bt_ptr,
        lens_ptr,
        out_ptr,
        scale,
        window,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ko,
        stride_kh,
        stride_vb,
        stride_vo,
        stride_vh,
        stride_bt,
        stride_ot,
        stride_oh,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        D_PAD: tl.constexpr,
        BS: tl.constexpr,
    ):
        # One program per (sequence, KV head): its G query heads attend to the
        # sequence's blocks with an online softmax (Milakov & Gimelshein 2018).
        s = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.load(lens_ptr + s)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, BS)
        gm = g < G
        dm = d < D
        q_off = s * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        q_pos = seq_len - 1
        # Branch-free window (no window = a window longer than any sequence);
        # blocks wholly before the window are skipped.
        first = tl.maximum(q_pos - window + 1, 0) // BS
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for j in range(first, tl.cdiv(seq_len, BS)):
            blk = tl.load(bt_ptr + s * stride_bt + j)
            pos = j * BS + t
            valid = (pos < seq_len) & (pos > q_pos - window)
            kv_mask = valid[:, None] & dm[None, :]
            k_off = blk * stride_kb + t[:, None] * stride_ko + h * stride_kh + d[None, :]
            k = tl.load(k_ptr + k_off, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, BS]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_off = blk * stride_vb + t[:, None] * stride_vo + h * stride_vh + d[None, :]
            v = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        o = acc / l_i[:, None]
        o_off = s * stride_ot + (h * G + g)[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])

    return kernel


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton paged decode attention straight from the cache (no gather).

    Args:
        q: ``[nd, num_heads, head_dim]``, one query token per sequence.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[nd, max_blocks]`` int64; seq_lens: ``[nd]`` int64.

    Returns:
        ``[nd, num_heads, head_dim]`` in ``q.dtype``.
    """
    import triton

    nd, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((nd, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if nd == 0:
        return out
    _decode_kernel()[(nd, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        scale,
        sliding_window or _NO_WINDOW,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        G=group,
        G_PAD=max(triton.next_power_of_2(group), 2),
        D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        BS=k_cache.shape[1],
    )
    return out
