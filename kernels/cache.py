"""Write new tokens' K/V into the paged KV cache (vLLM's ``reshape_and_cache``).

Cache layout (binding, see the team brief): one tensor per engine,
``kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``;
the per-layer views are ``k_cache = kv_cache[:, layer, 0]`` and
``v_cache = kv_cache[:, layer, 1]``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]`` and strided (block ``b`` of all layers is the contiguous ``kv_cache[b]``).
A token's slot is ``block_id * block_size + offset_in_block``.

``reshape_and_cache_ref`` (torch ``index_put_``) serves the CPU; the Triton
kernel (one program per token, copying its ``num_kv_heads * head_dim`` K and V
values) serves CUDA tensors.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tandem.kernels import backend, cpu_ext
from tandem.kernels.backend import KernelBackend
from tandem.kernels.host_memory import empty_huge_page_tensor
from tandem.kernels.kv_quant import is_fp8, quantize_kv

#: The slot of a padding row (a CUDA-graph batch padded to a captured size): its K/V
#: are not written (vLLM's ``PAD_SLOT_ID``).
PAD_SLOT_ID = -1


def allocate_kv_cache(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    shared_file: str | None = None,
    num_components: int = 2,
) -> torch.Tensor:
    """Zeroed ``[num_blocks, num_layers, num_components, block_size, num_kv_heads, head_dim]``
    cache: ``num_components`` 2 (K and V, the default) or 1 (an MLA model's latent entry,
    ``contracts.kv_layout.KVCacheSpec``).

    On the CPU it lives in transparent huge pages where the OS offers them
    (``kernels/host_memory.py``): decode attention reads it in scattered blocks.

    Args:
        shared_file: CPU only: map this file (``MAP_SHARED``) as the cache instead, so
            another process mapping it sees the same bytes (a worker process's cache,
            read by the engine core's KV connector). The file must hold exactly the
            cache's bytes and be zero-filled (a fresh ``memfd``, see
            ``engine/executor/multiproc.py``).

    Raises:
        ValueError: ``shared_file`` with a non-CPU device; ``num_components`` not 1 or 2.
    """
    if num_components not in (1, 2):
        raise ValueError(f"num_components must be 1 or 2, got {num_components}")
    shape = (num_blocks, num_layers, num_components, block_size, num_kv_heads, head_dim)
    if shared_file is not None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"shared_file: a shared KV cache is host memory, got {device}")
        numel = num_blocks * num_layers * num_components * block_size * num_kv_heads * head_dim
        return torch.from_file(shared_file, shared=True, size=numel, dtype=dtype).view(shape)
    if torch.device(device).type == "cpu":
        return empty_huge_page_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_cache_layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(k_cache, v_cache)`` views of ``kv_cache`` (``allocate_kv_cache``),
    each ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    With one component (an MLA latent cache) both entries are the same view: the latent
    is MLA's key and, its first ``kv_lora_rank`` elements, its value
    (``engine/models/mla.py``).
    """
    second = 1 if kv_cache.shape[2] == 2 else 0
    return [(kv_cache[:, i, 0], kv_cache[:, i, second]) for i in range(kv_cache.shape[1])]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    num_components: int = 2,
) -> int:
    """Bytes of one block across all layers, every component (K and V, or an MLA model's
    latent: ``num_components``): the unit the KV store moves."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * num_components * block_size * num_kv_heads * head_dim * elem


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


@functools.cache
def _cache_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        key_ptr,
        value_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        stride_kt,
        stride_vt,
        stride_kb,
        stride_ko,
        stride_vb,
        stride_vo,
        block_size,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t)
        # A negative slot is a padding row of a CUDA-graph batch: nothing to write.
        n_valid = tl.where(slot >= 0, N, 0)
        slot = tl.maximum(slot, 0)
        b = slot // block_size
        o = slot % block_size
        offs = tl.arange(0, BLOCK)
        mask = offs < n_valid
        k = tl.load(key_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + b * stride_kb + o * stride_ko + offs, k, mask=mask)
        tl.store(v_cache_ptr + b * stride_vb + o * stride_vo + offs, v, mask=mask)

    return kernel


def _heads_contiguous(t: torch.Tensor) -> bool:
    """``t[..., kvh, hd]``'s last two dims are one dense run of ``kvh * hd`` elements."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of ``reshape_and_cache_ref`` (takes the slots directly); a
    negative slot (``PAD_SLOT_ID``, a CUDA-graph batch's padding row) writes nothing,
    as vLLM's kernel does."""
    import triton

    if not _heads_contiguous(key):
        key = key.contiguous()
    if not _heads_contiguous(value):
        value = value.contiguous()
    assert _heads_contiguous(k_cache) and _heads_contiguous(v_cache), "cache heads not dense"
    n = key.shape[1] * key.shape[2]
    if key.shape[0]:
        _cache_kernel()[(key.shape[0],)](
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            value.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            k_cache.shape[1],
            N=n,
            BLOCK=triton.next_power_of_2(n),
        )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer_views: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    block_idx_offset: tuple[torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key/value: [num_tokens, num_kv_heads, head_dim]`` into their slots.

    Args:
        key, value: new tokens' K/V, the cache's dtype; or, for an FP8 cache
            (``kernels/kv_quant.py``), the compute dtype: quantized here as
            ``clamp(key / k_scale)`` (``value / v_scale``).
        kv_cache_layer_views: ``(k_cache, v_cache)`` of one layer, each
            ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``;
            ``PAD_SLOT_ID`` (-1) rows are skipped by the Triton kernel only (padding
            exists only in CUDA-graph batches, which run it).
        block_idx_offset: optional precomputed ``(slot // block_size,
            slot % block_size)`` (the model runner computes it once per step
            instead of once per layer).
        k_scale, v_scale: an FP8 cache's per-tensor scales (ignored otherwise).

    Raises:
        ValueError: on shape / dtype mismatches.
    """
    k_cache, v_cache = kv_cache_layer_views
    if is_fp8(k_cache.dtype) and key.dtype != k_cache.dtype:
        same = value is key  # an MLA latent: one entry, quantized once
        key = quantize_kv(key, k_scale, k_cache.dtype)
        value = key if same else quantize_kv(value, v_scale, v_cache.dtype)
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
    kind = backend.current().for_tensor(key)
    if kind is KernelBackend.TRITON:
        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    if kind is KernelBackend.CPU_NATIVE and cpu_ext.cache_write_cpu(
        key, value, k_cache, v_cache, slot_mapping
    ):
        return
    if block_idx_offset is None:
        block_size = k_cache.shape[1]
        block_idx_offset = (slot_mapping // block_size, slot_mapping % block_size)
    reshape_and_cache_ref(key, value, k_cache, v_cache, *block_idx_offset)
