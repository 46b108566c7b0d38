"""Native CPU attention wrappers: paged decode attention (float32 or bf16, K/V read in
place from the paged cache, ``csrc/paged_attention_cpu.c``) and bf16 prefill attention
of every prefill sequence in one call (``csrc/prefill_attention_cpu.c``), each with the
check of the tensors it serves (``supports``, ``prefill_attention_supports``).
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu_native import (
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HEADS,
    VECTOR_WIDTH,
    amx_available,
    load,
    use_tiles,
)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention_cpu`` can serve these tensors."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    return (
        num_heads <= MAX_HEADS
        and num_heads // k_cache.shape[2] <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % VECTOR_WIDTH == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and load() is not None
    )


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Decode attention straight from the paged cache (no gather), on the CPU.

    Args:
        q: ``[nd, num_heads, head_dim]`` float32 or bfloat16, one query token per
            sequence (its last position), last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (strided layer views are fine; last dim contiguous), ``q``'s dtype.
        block_tables: ``[nd, max_blocks]`` int64; seq_lens: ``[nd]`` int64
            context lengths in tokens, including the new token.
        scale: softmax scale; sliding_window: optional window in tokens.
        tiles: bf16 only: compute the scores on AMX tiles (``None``: where
            ``amx_available()``; ``False``: with AVX512-BF16 dot products, as on
            CPUs without AMX). Shapes those paths do not take (block_size % 16,
            head_dim % 32, more than 16 query heads per KV head) run the generic
            vector code either way.

    Returns:
        ``[nd, num_heads, head_dim]`` in ``q.dtype`` (float32 accumulation).

    Raises:
        RuntimeError: when the library is unavailable (check ``supports`` first)
            or the kernel reports an unsupported shape or allocation failure.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available")
    nd, num_heads, head_dim = q.shape
    out = torch.empty((nd, num_heads, head_dim), dtype=q.dtype)
    if nd == 0:
        return out
    bt = block_tables.contiguous()
    lens = seq_lens.contiguous()
    window = sliding_window if sliding_window is not None else 2**62
    on_tiles = q.dtype == torch.bfloat16 and tiles is not False and amx_available()
    rc = lib.paged_decode_attention(
        int(q.dtype == torch.bfloat16),
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.data_ptr(), bt.stride(0), lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        nd, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        float(scale), window, int(on_tiles), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention_cpu failed with code {rc}")
    return out


def prefill_attention_supports(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether ``prefill_attention_cpu`` serves this query and these cache views: bf16
    on a CPU with AVX512-BF16 (AMX optional), head_dim % 32 == 0 and <= 256."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    lib = load()
    return (
        query.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and v_cache.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and head_dim % 32 == 0
        and head_dim <= 256
        and num_heads % k_cache.shape[2] == 0
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        # K rows are read as 32-bit pairs (and gathered with stride sk_o / 2)
        and all(st % 2 == 0 for st in k_cache.stride()[:3])
        and k_cache.data_ptr() % 4 == 0
        and lib is not None
        and bool(lib.prefill_attention_bf16_available())
    )


def prefill_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    desc: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    tiles: bool | None = None,
) -> None:
    """Causal attention of every prefill sequence in one native call, K/V read from
    the paged cache (the new tokens' K/V must be written there first); see
    ``csrc/prefill_attention_cpu.c`` for the algorithm. Needs
    ``prefill_attention_supports``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` bf16, head dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` bf16
            views (any block / offset / head strides).
        desc, tables: ``AttentionMetadata.prefill_descriptors()``.
        scale: softmax scale; sliding_window: in tokens, or ``None``.
        out: ``[num_tokens, num_heads, head_dim]`` bf16; the prefill rows are written.
        tiles: the products on AMX tiles (``None``: where ``amx_available()``;
            ``False``: AVX512-BF16 dot products, for tests on AMX machines).

    Raises:
        RuntimeError: ``tiles=True`` without AMX here, or when the kernel rejects
            the shapes or cannot allocate.
    """
    on_tiles = use_tiles(tiles)
    lib = load()
    assert lib is not None
    num_heads, head_dim = query.shape[1], query.shape[2]
    rc = lib.prefill_attention_bf16(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        desc.data_ptr(), tables.data_ptr(), desc.shape[0],
        out.data_ptr(), out.stride(0), out.stride(1),
        num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        float(scale), int(sliding_window or 0), int(on_tiles), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"prefill_attention_bf16 failed with code {rc}")
