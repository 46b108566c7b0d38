"""Paged attention with explicit scores: logit softcapping and attention sinks.

The fused paths (``kernels/attention.py``: SDPA, the native CPU kernels, Triton) take a
scale, a causal structure and a sliding window, nothing that changes the scores between
``q @ k^T`` and the softmax. Two model families do change them:

* logit softcapping (Gemma 2, Team Gemma 2024): ``s = cap * tanh(s / cap)`` before the mask;
* attention sinks (gpt-oss, OpenAI 2025; Xiao et al. 2023, "Efficient Streaming Language
  Models with Attention Sinks"): one learned logit per query head joins each row's
  softmax and is dropped after it, so a row's probabilities sum to less than one.

``paged_attention_math`` computes those scores explicitly (float32, per sequence, K/V
gathered from the cache as the reference path does), with the same metadata contract as
``paged_attention_ref``. ``paged_attention`` routes a call here whenever it is given a
softcap or sinks: no fused path silently drops either.
"""

from __future__ import annotations

import torch

from tandem.kernels.attention_metadata import AttentionMetadata

#: prefill queries per score matrix (see ``paged_attention_math``)
QUERY_TILE = 256


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    k_len: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of a batch of query rows to their own keys, scores made explicit.

    Args:
        q: ``[B, n, H, D]``; k, v: ``[B, L, KVH, D]`` (``H`` a multiple of ``KVH``).
        q_pos: ``[B, n]`` int64 positions of the queries; k_pos: ``[L]`` positions of
            the keys (the same for every row); k_len: ``[B]`` keys that exist per row
            (the rest is padding that may hold anything, NaN included).
        scale / sliding_window / softcap / sinks: see ``paged_attention_math``.

    Returns:
        ``[B, n, H, D]`` in ``q.dtype``.
    """
    b, n, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    valid = k_pos[None, :] < k_len[:, None]  # [B, L]
    # Zero the padding: a masked probability is 0, and 0 * NaN is still NaN.
    k = k.float().masked_fill(~valid[:, :, None, None], 0.0)
    v = v.float().masked_fill(~valid[:, :, None, None], 0.0)
    qf = q.float().view(b, n, kvh, g, d)
    s = torch.einsum("bnkgd,blkd->bkgnl", qf, k) * scale  # [B, KVH, G, n, L]
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    see = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]  # [B, n, L]
    if sliding_window:
        see &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    s = s.masked_fill(~see[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kvh, g, 1, 1).expand(b, kvh, g, n, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    o = torch.einsum("bkgnl,blkd->bnkgd", p, v)
    return o.reshape(b, n, h, d).to(q.dtype)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` -> ``[*block_ids.shape[:-1], nb * block_size, kvh, hd]``.

    NOTE: ``index_select`` on dim 0 copies whole blocks with memcpy; advanced
    indexing (``cache[ids]``) of the strided layer view is slower on CPU
    (docs/benchmarks.md).
    """
    g = cache.index_select(0, block_ids.reshape(-1))
    return g.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def paged_attention_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged attention with explicit float32 scores (any head size, any device).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens (already
            written into the cache).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta: the step's ``AttentionMetadata``.
        scale: softmax scale.
        sliding_window: key ``k`` visible from query ``q`` iff ``q - k < window``.
        softcap: ``cap`` of ``cap * tanh(scores / cap)`` (after the scale, before the
            mask), or ``None``.
        sinks: ``[num_heads]`` per-head sink logits that join each row's softmax, or
            ``None``.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    device = query.device
    nd = meta.num_decodes
    if nd:
        bt, lens = meta.decode_block_tables, meta.decode_seq_lens
        assert bt is not None and lens is not None, "decode group without block tables"
        idx = meta.decode_token_idx
        q = query[:nd] if idx is None else query[idx]
        k = gather_blocks(k_cache, bt)  # [nd, L, KVH, D]
        v = gather_blocks(v_cache, bt)
        k_pos = torch.arange(k.shape[1], device=device)
        o = _attend(q[:, None], k, v, (lens - 1)[:, None], k_pos, lens, scale, sliding_window,
                    softcap, sinks)[:, 0]
        if idx is None:
            out[:nd] = o
        else:
            out[idx] = o
    for p in meta.prefills:
        s, e = p.token_start, p.token_end
        if p.block_ids is None:
            k, v = key[s:e], value[s:e]
        else:
            k = gather_blocks(k_cache, p.block_ids)[: p.seq_len]
            v = gather_blocks(v_cache, p.block_ids)[: p.seq_len]
        # Query tiles keep the float32 scores of a long prompt within
        # QUERY_TILE * seq_len * num_heads elements.
        for t0 in range(0, p.num_new, QUERY_TILE):
            t1 = min(p.num_new, t0 + QUERY_TILE)
            stop = p.num_computed + t1  # keys past the tile's last query are never seen
            q_pos = torch.arange(p.num_computed + t0, stop, device=device)
            k_pos = torch.arange(stop, device=device)
            lens = torch.tensor([stop], device=device)
            out[s + t0 : s + t1] = _attend(query[None, s + t0 : s + t1], k[None, :stop],
                                           v[None, :stop], q_pos[None], k_pos, lens, scale,
                                           sliding_window, softcap, sinks)[0]
    return out
