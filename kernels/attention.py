"""Paged attention over the block-table KV cache (the torch reference path).

Algorithm (vLLM's PagedAttention, Kwon et al. 2023, with a gather-based CPU
reference): the model runner flattens every scheduled token of a step into one
"super sequence". K/V of the new tokens are first written into their slots
(``kernels/cache.py``); then each sequence attends to its whole context.

* Sequences with exactly one new token (decodes, and 1-token prefill chunks)
  form the *decode group*: their blocks are gathered through a padded block
  table ``[num_decodes, max_blocks]`` and all are computed in ONE
  ``scaled_dot_product_attention`` call with a padding mask. GQA needs no
  repeat: the ``G = num_heads // num_kv_heads`` query heads sharing a KV head
  are laid out as the query-length axis of that KV head.
* Every other sequence (a prompt or a chunk of one) is a *prefill*: without a
  cached prefix it attends causally to its own new K/V (no cache read); with a
  prefix (prefix-cache hit or a later chunk) it gathers its blocks and uses a
  causal mask offset by the number of cached tokens.

On the CPU the decode group runs a native kernel (``kernels/cpu_ext.py``) that
also reads K/V in place, when a C compiler could build it; the gather + SDPA path
above is the reference and the fallback.

On CUDA (with Triton installed) the decode group runs a Triton kernel that
reads K/V straight from the blocks (no gather), one program per (sequence, KV
head) with an online softmax; prefills use SDPA: FlashAttention for a fresh prompt in
half types, else (a cached prefix, a later chunk, a window, float32) query tiles whose
score matrix stays within a fixed budget, in the layout SDPA's memory-efficient kernel
takes (``attention_backend.plan_prefill_attention``).

Batch-invariant mode (``ModelConfig.deterministic``): the metadata puts every query
token in the decode group, one row each (``build_attention_metadata(...,
batch_invariant=True)``), so each token's attention is computed by the same per-query
kernel whether it came in a prompt, a chunk or a decode step; see docs/architecture.md.

Optional sliding-window attention (Mistral): key ``k`` is visible from query
``q`` iff ``k <= q`` and ``q - k < window`` (transformers' convention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.kernels import backend, cpu_ext
from tandem.kernels.attention_backend import (
    FLASH_DTYPES,
    FLASH_MAX_HEAD_DIM,
    AttentionBackend,
    PrefillPath,
    PrefillPlan,
    detect_attention_facts,
    plan_prefill_attention,
)
from tandem.kernels.attention_math import gather_blocks, paged_attention_math
from tandem.kernels.attention_metadata import (
    AttentionMetadata,
    PrefillSeq,
    build_attention_metadata,
)
from tandem.kernels.attention_triton import decode_attention_triton
from tandem.kernels.backend import KernelBackend
from tandem.kernels.kv_quant import fp8_triton_decode_applies, is_fp8, paged_attention_fp8

__all__ = [
    "AttentionMetadata",
    "PrefillSeq",
    "build_attention_metadata",
    "decode_attention_triton",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_ref",
    "paged_attention_triton",
]


def _decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Decode group via gather + one SDPA call: ``q [nd, H, hd]`` -> ``[nd, H, hd]``."""
    nd, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    bt = meta.decode_block_tables
    assert bt is not None, "decode group without block tables"
    k = gather_blocks(k_cache, bt).transpose(1, 2)  # [nd, kvh, L, hd]
    v = gather_blocks(v_cache, bt).transpose(1, 2)
    # GQA without repeat: the group's query heads play the query-length axis.
    q = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.decode_mask(sliding_window), scale=scale
    )
    return o.reshape(nd, num_heads, head_dim)


def _prefill_attention_sdpa(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Every prefill sequence via SDPA, written into ``out``: each as its
    ``_prefill_plan`` says (FlashAttention for an unmasked CUDA prefill in half types,
    query tiles of bounded score memory for the other CUDA ones, one call on the CPU)."""
    group = query.shape[1] // key.shape[1]
    for i, p in enumerate(meta.prefills):
        s, e = p.token_start, p.token_end
        # Keys before the first one any new query sees are left out: a slot before a
        # sliding window may hold anything, and a masked NaN value still makes NaN.
        lo = max(0, p.num_computed - sliding_window + 1) if sliding_window else 0
        if p.block_ids is None:
            k = key[s:e]
            v = value[s:e]
        else:
            k = gather_blocks(k_cache, p.block_ids)[lo : p.seq_len]
            v = gather_blocks(v_cache, p.block_ids)[lo : p.seq_len]
        plan = _prefill_plan(query, key.shape[1], p.num_new, p.seq_len - lo,
                             p.needs_mask(sliding_window))
        if plan.path is PrefillPath.TILED:
            _prefill_tiled(out[s:e], query[s:e], k, v, p.num_computed, lo, sliding_window,
                           scale, plan.query_tile)
            continue
        # contiguous(): SDPA on CPU runs several times slower on these strided
        # views than on a [1, heads, n, hd] copy (measured, bf16 and fp32).
        q = query[s:e].transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, n, hd]
        k = k.transpose(0, 1).unsqueeze(0).contiguous()  # [1, kvh, L, hd]
        v = v.transpose(0, 1).unsqueeze(0).contiguous()
        mask = meta.prefill_mask(i, sliding_window)
        if mask is not None and lo:
            mask = mask[:, lo:]
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[s:e] = o[0].transpose(0, 1)


@functools.cache
def _sdpa_flash_enabled() -> bool:
    return detect_attention_facts().sdpa_flash


def _prefill_plan(
    query: torch.Tensor, num_kv_heads: int, num_queries: int, num_keys: int, masked: bool
) -> PrefillPlan:
    """``plan_prefill_attention`` of one prefill of ``query``'s model (``[num_tokens,
    num_heads, head_dim]``): its device, heads, dtype and whether FlashAttention takes
    them. Tests replace it to run a GPU's plan on the CPU."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    flash = (query.device.type == "cuda" and query.dtype in FLASH_DTYPES
             and head_dim % 8 == 0 and head_dim <= FLASH_MAX_HEAD_DIM and _sdpa_flash_enabled())
    return plan_prefill_attention(query.device.type, num_heads, num_kv_heads, head_dim,
                                  query.element_size(), num_queries, num_keys, masked, flash)


def _prefill_tiled(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_computed: int,
    key_start: int,
    sliding_window: int | None,
    scale: float,
    tile: int,
) -> None:
    """One prefill by ``PrefillPath.TILED``: SDPA per tile of ``tile`` queries, the
    ``G = num_heads // num_kv_heads`` query heads of a KV head laid out along the query
    axis (no ``enable_gqa``: with it no kernel but the math one takes a mask), an
    explicit causal (and window) mask, and only the keys the tile's queries can see.

    Args:
        out: ``[n, num_heads, head_dim]``, written.
        query: ``[n, num_heads, head_dim]`` at positions ``num_computed..``.
        key, value: ``[L, num_kv_heads, head_dim]`` at positions ``key_start..``, up to
            the last query's.
        sliding_window: optional window in tokens; scale: softmax scale.
        tile: queries per SDPA call (``PrefillPlan.query_tile``).
    """
    n, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    k = key.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, kvh, L, hd]
    v = value.permute(1, 0, 2).unsqueeze(0).contiguous()
    device = query.device
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        rows = t1 - t0
        first, stop = num_computed + t0, num_computed + t1  # the tile's query positions
        k_lo = max(key_start, first - sliding_window + 1) if sliding_window else key_start
        # [kvh, G * rows, hd]: row g * rows + t is query t of head kv * G + g
        q = query[t0:t1].permute(1, 0, 2).reshape(num_kv_heads, group * rows, head_dim)
        q_pos = torch.arange(first, stop, device=device)[:, None]
        k_pos = torch.arange(k_lo, stop, device=device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window:
            mask &= k_pos > q_pos - sliding_window
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            k[:, :, k_lo - key_start : stop - key_start],
            v[:, :, k_lo - key_start : stop - key_start],
            attn_mask=mask.repeat(group, 1),
            scale=scale,
        )
        out[t0:t1] = o[0].view(num_heads, rows, head_dim).transpose(0, 1)


def _prefill_attention_cpu(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Every prefill sequence in one native call (bf16 on AMX tiles or AVX512-BF16,
    K/V from the cache) where the CPU and shapes allow it, else SDPA per sequence."""
    if meta.prefills and cpu_ext.prefill_attention_supports(query, k_cache, v_cache):
        desc, tables = meta.prefill_descriptors()
        cpu_ext.prefill_attention_cpu(
            query, k_cache, v_cache, desc, tables, scale, sliding_window, out
        )
        return
    _prefill_attention_sdpa(out, query, key, value, k_cache, v_cache, meta, scale, sliding_window)


PrefillAttention = Callable[..., None]
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"],
    torch.Tensor,
]


def _decode_group(
    out: torch.Tensor,
    query: torch.Tensor,
    meta: AttentionMetadata,
    attend: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Run ``attend`` on the decode group's queries ``[nd, H, hd]``, write into ``out``."""
    nd = meta.num_decodes
    if not nd:
        return
    idx = meta.decode_token_idx
    o = attend(query[:nd] if idx is None else query[idx])
    if idx is None:
        out[:nd] = o
    else:
        out[idx] = o


def _paged_attention_with(
    decode: DecodeAttention, doc: str, prefill: PrefillAttention = _prefill_attention_sdpa
) -> Callable[..., torch.Tensor]:
    """A paged attention whose decode group runs ``decode`` and prefills ``prefill``."""

    def impl(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        _decode_group(
            out, query, meta, lambda q: decode(q, k_cache, v_cache, meta, scale, sliding_window)
        )
        prefill(out, query, key, value, k_cache, v_cache, meta, scale, sliding_window)
        return out

    impl.__doc__ = doc
    return impl


paged_attention_ref = _paged_attention_with(
    _decode_attention_sdpa,
    """Reference paged attention; see the module docstring for the algorithm.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` of the new tokens
            (already written into the cache).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta: the step's ``AttentionMetadata``.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: optional window in tokens.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """,
)


def _block_table_decode(kernel: Callable[..., torch.Tensor]) -> DecodeAttention:
    """Adapt a ``kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, window)``
    (the native CPU and Triton decode kernels) to the ``DecodeAttention`` shape."""

    def decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        return kernel(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            scale,
            sliding_window,
        )

    return decode


_decode_attention_native = _block_table_decode(
    lambda *args: cpu_ext.paged_decode_attention_cpu(*args)
)


def _decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The decode group by the native kernel where it serves these tensors, else SDPA."""
    attend = _decode_attention_native if cpu_ext.supports(q, k_cache) else _decode_attention_sdpa
    return attend(q, k_cache, v_cache, meta, scale, sliding_window)


paged_attention_cpu = _paged_attention_with(
    _decode_attention_cpu,
    """CPU path: the decode group by the native kernel that reads K/V in place
    (``kernels/cpu_ext.py``), bf16 prefills by the native prefill kernel where
    the CPU has AVX512-BF16 (on AMX tiles where it has AMX); each falls back to
    the gather + SDPA reference where its kernel does not serve the tensors. Same
    contract as ``paged_attention_ref``.""",
    _prefill_attention_cpu,
)



paged_attention_triton = _paged_attention_with(
    _block_table_decode(decode_attention_triton),
    """GPU path: the decode group by the Triton kernel, prefills by SDPA
    (FlashAttention); same contract as ``paged_attention_ref``.""",
)


_IMPLEMENTATIONS: dict[AttentionBackend, Callable[..., torch.Tensor]] = {
    AttentionBackend.CPU_NATIVE: paged_attention_cpu,
    AttentionBackend.TRITON_PAGED: paged_attention_triton,
    AttentionBackend.TORCH_SDPA: paged_attention_ref,
}


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer_views: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Checked paged attention: ``meta.attention_backend``'s implementation when the
    runner chose one, else by the tensors' kernel backend (Triton on CUDA, the native
    kernel or the torch reference on CPU). With a ``softcap`` or ``sinks``, which no
    fused path computes, the explicit-score path (``kernels/attention_math.py``).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` (already cached).
        kv_cache_layer_views: ``(k_cache, v_cache)`` of this layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta, scale, sliding_window: see ``paged_attention_ref``.
        softcap, sinks: see ``paged_attention_math`` (Gemma 2's logit softcapping,
            gpt-oss's per-head sink logits ``[num_heads]``).
        k_scale, v_scale: an FP8 cache's scales (``kernels/kv_quant.py``): the Triton
            decode kernel reads it in place, every other path its blocks dequantized.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.

    Raises:
        ValueError: on inconsistent shapes or dtypes.
    """
    k_cache, v_cache = kv_cache_layer_views
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError("query/key/value must be [num_tokens, heads, head_dim]")
    if query.shape[0] != meta.num_tokens or key.shape[0] != meta.num_tokens:
        raise ValueError(
            f"num_tokens mismatch: query {query.shape[0]}, key {key.shape[0]}, "
            f"metadata {meta.num_tokens}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"num_heads {query.shape[1]} must be a multiple of num_kv_heads {key.shape[1]}"
        )
    if k_cache.shape[1] != meta.block_size or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"cache view {tuple(k_cache.shape)} does not fit key {tuple(key.shape)}")
    if is_fp8(k_cache.dtype) and query.dtype == key.dtype and v_cache.dtype == k_cache.dtype:
        in_place = fp8_triton_decode_applies(query, meta, softcap, sinks)
        return paged_attention_fp8(
            query, key, value, k_cache, v_cache, meta, scale, k_scale, v_scale,
            lambda q, k, v, kc, vc, m: paged_attention(q, k, v, (kc, vc), m, scale,
                                                       sliding_window, softcap, sinks),
            functools.partial(decode_attention_triton, sliding_window=sliding_window)
            if in_place else None)
    if not (query.dtype == key.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("query, key and the cache must share a dtype")
    if softcap or sinks is not None:
        if sinks is not None and sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must be [num_heads={query.shape[1]}], got {tuple(sinks.shape)}")
        return paged_attention_math(query, key, value, k_cache, v_cache, meta, scale,
                                    sliding_window, softcap, sinks)
    chosen = meta.attention_backend
    if chosen is not None:
        impl = _IMPLEMENTATIONS[chosen]
    elif backend.current().for_tensor(query) is KernelBackend.TRITON:
        impl = paged_attention_triton
    elif query.device.type == "cpu":
        # the torch backend on the CPU too: its decode groups fall back to SDPA
        impl = paged_attention_cpu
    else:
        impl = paged_attention_ref
    return impl(query, key, value, k_cache, v_cache, meta, scale, sliding_window)
