"""Write new tokens' K/V into the paged KV cache (vLLM's ``reshape_and_cache``).

Cache layout (binding, see the team brief): one tensor per engine,
``kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``;
the per-layer views are ``k_cache = kv_cache[:, layer, 0]`` and
``v_cache = kv_cache[:, layer, 1]``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]`` and strided (block ``b`` of all layers is the contiguous ``kv_cache[b]``).
A token's slot is ``block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

import torch


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Zeroed ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` cache."""
    return torch.zeros(
        (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
    )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block across all layers, K and V (the unit the KV store moves)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_idx: torch.Tensor,
    block_offset: torch.Tensor,
) -> None:
    """Reference: ``k_cache[block_idx[t], block_offset[t]] = key[t]`` (same for V), in place."""
    k_cache.index_put_((block_idx, block_offset), key)
    v_cache.index_put_((block_idx, block_offset), value)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer_views: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    block_idx_offset: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write ``key/value: [num_tokens, num_kv_heads, head_dim]`` into their slots.

    Args:
        key, value: new tokens' K/V, the cache's dtype.
        kv_cache_layer_views: ``(k_cache, v_cache)`` of one layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``.
        block_idx_offset: optional precomputed ``(slot // block_size,
            slot % block_size)`` (the model runner computes it once per step
            instead of once per layer).

    Raises:
        ValueError: on shape / dtype mismatches.
    """
    k_cache, v_cache = kv_cache_layer_views
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if k_cache.shape[2:] != key.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache view {tuple(k_cache.shape)} does not fit key {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"key dtype {key.dtype} != cache dtype {k_cache.dtype}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{key.shape[0]}], got "
            f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if block_idx_offset is None:
        block_size = k_cache.shape[1]
        block_idx_offset = (slot_mapping // block_size, slot_mapping % block_size)
    reshape_and_cache_ref(key, value, k_cache, v_cache, *block_idx_offset)
