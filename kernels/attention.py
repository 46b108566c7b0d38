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

Optional sliding-window attention (Mistral): key ``k`` is visible from query
``q`` iff ``k <= q`` and ``q - k < window`` (transformers' convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One multi-token sequence of a step.

    Attributes:
        token_start / token_end: its slice of the flattened batch (tokens).
        num_computed: tokens of this sequence already in the cache before this
            step (prefix hits and earlier chunks).
        block_ids: ``[ceil(seq_len / block_size)]`` int64 block ids covering the
            context, or ``None`` when ``num_computed == 0`` (attend to new K/V).
    """

    token_start: int
    token_end: int
    num_computed: int
    block_ids: torch.Tensor | None

    @property
    def num_new(self) -> int:
        return self.token_end - self.token_start

    @property
    def seq_len(self) -> int:
        return self.num_computed + self.num_new


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once and shared by all layers.

    Attributes:
        num_tokens: tokens in the flattened batch.
        block_size: tokens per KV block.
        positions: ``[num_tokens]`` int64 absolute positions.
        slot_mapping: ``[num_tokens]`` int64 cache slots (``block * block_size + off``).
        block_idx / block_offset: ``slot_mapping // block_size`` and ``% block_size``.
        num_decodes: sequences in the decode group (one new token each).
        decode_token_idx: ``[num_decodes]`` int64 token indices of the decode
            group, or ``None`` when they are the first ``num_decodes`` tokens.
        decode_block_tables: ``[num_decodes, max_blocks]`` int64, padded with 0.
        decode_seq_lens: ``[num_decodes]`` int64 context lengths (incl. the new token).
        prefills: the multi-token sequences.
    """

    num_tokens: int
    block_size: int
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_idx: torch.Tensor
    block_offset: torch.Tensor
    num_decodes: int = 0
    decode_token_idx: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)
    _masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def decode_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """``[num_decodes, 1, 1, max_blocks * block_size]`` bool, True = attend."""
        key = ("decode", sliding_window)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_tables is not None and self.decode_seq_lens is not None
            max_len = self.decode_block_tables.shape[1] * self.block_size
            k_pos = torch.arange(max_len, device=self.decode_seq_lens.device)
            lens = self.decode_seq_lens[:, None]
            mask = k_pos[None, :] < lens
            if sliding_window is not None:
                mask &= k_pos[None, :] > lens - 1 - sliding_window
            mask = mask[:, None, None, :]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, i: int, sliding_window: int | None = None) -> torch.Tensor | None:
        """``[num_new, seq_len]`` bool mask of prefill ``i``; ``None`` = plain causal."""
        key = ("prefill", i, sliding_window)
        if key in self._masks:
            return self._masks[key]
        p = self.prefills[i]
        mask = None
        if p.num_computed > 0 or (sliding_window is not None and p.seq_len > sliding_window):
            device = self.positions.device
            q_pos = torch.arange(p.num_computed, p.seq_len, device=device)[:, None]
            k_pos = torch.arange(p.seq_len, device=device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        self._masks[key] = mask
        return mask


def build_attention_metadata(
    query_lens: list[int],
    num_computed: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the per-step metadata for sequences laid out back to back.

    Args:
        query_lens: new tokens per sequence (>= 1), in batch order.
        num_computed: tokens already cached per sequence.
        block_tables: block ids per sequence, covering at least
            ``num_computed + query_len`` tokens.
        block_size: tokens per block.
        device: where the tensors go.

    Raises:
        ValueError: on length mismatches, empty queries or short block tables.
    """
    if not (len(query_lens) == len(num_computed) == len(block_tables)):
        raise ValueError("query_lens, num_computed and block_tables must have equal lengths")
    positions: list[int] = []
    slots: list[int] = []
    decode_idx: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefill_specs: list[tuple[int, int, int, list[int]]] = []
    start = 0
    for n, c, table in zip(query_lens, num_computed, block_tables, strict=True):
        if n < 1:
            raise ValueError(f"query_lens must be >= 1, got {n}")
        end_pos = c + n
        num_blocks = -(-end_pos // block_size)
        if len(table) < num_blocks:
            raise ValueError(
                f"block table has {len(table)} blocks, {num_blocks} needed for {end_pos} tokens"
            )
        if n == 1:
            positions.append(c)
            slots.append(table[c // block_size] * block_size + c % block_size)
            decode_idx.append(start)
            decode_tables.append(table[:num_blocks])
            decode_lens.append(end_pos)
        else:
            positions.extend(range(c, end_pos))
            # Slots block by block: Python work per block, not per token.
            pos = c
            while pos < end_pos:
                j, off = divmod(pos, block_size)
                stop = min(end_pos, (j + 1) * block_size)
                base = table[j] * block_size
                slots.extend(range(base + off, base + off + stop - pos))
                pos = stop
            prefill_specs.append((start, start + n, c, table[:num_blocks]))
        start += n
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        num_tokens=start,
        block_size=block_size,
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=slot_mapping,
        block_idx=slot_mapping // block_size,
        block_offset=slot_mapping % block_size,
    )
    if decode_idx:
        max_blocks = max(len(t) for t in decode_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in decode_tables]
        meta.num_decodes = len(decode_idx)
        if decode_idx != list(range(len(decode_idx))):
            meta.decode_token_idx = torch.tensor(decode_idx, dtype=torch.int64, device=device)
        meta.decode_block_tables = torch.tensor(padded, dtype=torch.int64, device=device)
        meta.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
    for s, e, c, table in prefill_specs:
        ids = torch.tensor(table, dtype=torch.int64, device=device) if c > 0 else None
        meta.prefills.append(PrefillSeq(s, e, c, ids))
    return meta


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` -> ``[*block_ids.shape[:-1], nb * block_size, kvh, hd]``.

    NOTE: ``index_select`` on dim 0 copies whole blocks with memcpy; advanced
    indexing (``cache[ids]``) of the strided layer view is ~2.5x slower on CPU.
    """
    g = cache.index_select(0, block_ids.reshape(-1))
    return g.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def paged_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
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
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        idx = meta.decode_token_idx
        q = query[:nd] if idx is None else query[idx]
        bt = meta.decode_block_tables
        assert bt is not None, "decode group without block tables"
        k = _gather(k_cache, bt).transpose(1, 2)  # [nd, kvh, L, hd]
        v = _gather(v_cache, bt).transpose(1, 2)
        # GQA without repeat: the group's query heads play the query-length axis.
        q = q.view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=meta.decode_mask(sliding_window), scale=scale
        ).reshape(nd, num_heads, head_dim)
        if idx is None:
            out[:nd] = o
        else:
            out[idx] = o
    for i, p in enumerate(meta.prefills):
        s, e = p.token_start, p.token_end
        q = query[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        if p.block_ids is None:
            k = key[s:e]
            v = value[s:e]
        else:
            k = _gather(k_cache, p.block_ids)[: p.seq_len]
            v = _gather(v_cache, p.block_ids)[: p.seq_len]
        k = k.transpose(0, 1).unsqueeze(0)  # [1, kvh, L, hd]
        v = v.transpose(0, 1).unsqueeze(0)
        mask = meta.prefill_mask(i, sliding_window)
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
    return out


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer_views: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Checked paged attention (dispatches to the torch reference).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` (already cached).
        kv_cache_layer_views: ``(k_cache, v_cache)`` of this layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta, scale, sliding_window: see ``paged_attention_ref``.

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
    if not (query.dtype == key.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("query, key and the cache must share a dtype")
    return paged_attention_ref(query, key, value, k_cache, v_cache, meta, scale, sliding_window)
