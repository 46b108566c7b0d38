"""An FP8 KV cache (vLLM's ``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``): write and read.

The cache tensor is stored as ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (one byte
per element, half a bf16 cache), with one scale per tensor and layer for K and one for V
(vLLM's ``k_scale`` / ``v_scale``; 1.0 unless the checkpoint carries calibrated ones):

* write (``quantize_kv``): ``q = clamp(x / scale, -max, max).to(fp8)``, in float32 so the
  division rounds once, the clamp because an out-of-range value would become NaN (e4m3fn
  has no infinity) or inf (e5m2);
* read (``dequantize_kv``): ``x = q.to(float32) * scale``, then the compute dtype.

Every attention path reads it: the Triton decode kernel loads the fp8 bytes and upcasts in
registers (its ``tl.load(...).to(tl.float32)``), the K scale folded into the softmax scale
and the V scale applied to the output. Paths that cannot read fp8 (the native CPU decode
and prefill kernels, SDPA, the explicit-score path) get the blocks this step references
dequantized into a compact cache of the compute dtype, with the metadata's block ids
remapped to it (``dequantized_step``), so they never misread fp8 bytes as another type.
The new tokens' own K/V are rounded through fp8 too (``fake_quantize``), so a fresh prompt
attends to exactly what a later step reads from the cache (cold, chunked and prefix-hit
runs see the same values).
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Sequence

import torch

from tandem.contracts.kv_layout import KV_CACHE_DTYPES
from tandem.kernels import backend
from tandem.kernels.attention_backend import AttentionBackend
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.backend import KernelBackend

_FP8: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache: the model's for "auto", else the FP8 format.

    Raises:
        ValueError: naming ``kv_cache_dtype`` for a name not in ``KV_CACHE_DTYPES``.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _FP8:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return _FP8[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the FP8 cache dtypes."""
    return dtype in FP8_DTYPES


def check_fp8_kv_cache_supported(
    cache_dtype: torch.dtype, device_type: str, capability: tuple[int, int] | None = None
) -> None:
    """Refuse at start-up an FP8 cache this device cannot compute with.

    The CPU converts both formats in torch (and the native kernels read the dequantized
    blocks). A GPU needs Triton's FP8 conversions: e4m3 (``fp8e4nv``) from compute
    capability 8.9 (Ada, Hopper), e5m2 from 8.0.

    Args:
        cache_dtype: the resolved cache dtype (a non-FP8 one always passes).
        device_type: "cpu" or "cuda".
        capability: the GPU's ``(major, minor)`` compute capability (CUDA only).

    Raises:
        ValueError: naming ``kv_cache_dtype``, for an FP8 format the device cannot run.
    """
    if not is_fp8(cache_dtype) or device_type == "cpu":
        return
    if device_type != "cuda" or capability is None:
        raise ValueError(f"kv_cache_dtype: an FP8 KV cache is not supported on {device_type!r}")
    need = (8, 9) if cache_dtype == torch.float8_e4m3fn else (8, 0)
    if tuple(capability) < need:
        raise ValueError(
            f"kv_cache_dtype: {str(cache_dtype).removeprefix('torch.')} needs a GPU of compute "
            f"capability >= {need[0]}.{need[1]}, this one is {capability[0]}.{capability[1]} "
            "(use fp8_e5m2 or auto)"
        )


def scales_id(scales: Sequence[tuple[float, float]]) -> str:
    """A short stable identity of the per-layer ``(k_scale, v_scale)`` pairs: 16 hex
    digits of SHA-256 over their float32 bytes. It enters the KV layout fingerprint, so
    blocks written under other scales are a miss, never misread."""
    raw = b"".join(struct.pack("<ff", float(k), float(v)) for k, v in scales)
    return hashlib.sha256(raw).hexdigest()[:16]


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(x / scale)`` cast to the FP8 ``dtype``, same shape as ``x`` (any dtype)."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-top, top).to(dtype)


def dequantize_kv(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``q.float() * scale`` in ``dtype``, same shape as the FP8 ``q``."""
    x = q.float()
    if scale != 1.0:
        x.mul_(scale)
    return x.to(dtype)


def fake_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded through the FP8 ``dtype`` and back: what the cache will give back."""
    return dequantize_kv(quantize_kv(x, scale, dtype), scale, x.dtype)


def _remap(meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    """The block ids ``meta`` reads (ascending) and ``meta`` with each id replaced by its
    index in them, so a cache of only those blocks serves the step."""
    device = meta.slot_mapping.device
    parts = [torch.tensor([b for p in meta.prefills for b in p.block_table], dtype=torch.int64,
                          device=device)]
    if meta.decode_block_tables is not None:
        parts.append(meta.decode_block_tables.reshape(-1))
    used = torch.unique(torch.cat(parts))
    if used.numel() == 0:
        return used, meta
    remap = torch.zeros(int(used.max()) + 1, dtype=torch.int64, device=device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int64, device=device)
    prefills = [
        dataclasses.replace(
            p,
            block_ids=None if p.block_ids is None else remap[p.block_ids],
            block_table=remap[torch.tensor(p.block_table, dtype=torch.int64,
                                           device=device)].tolist(),
        )
        for p in meta.prefills
    ]
    bt = meta.decode_block_tables
    remapped = dataclasses.replace(
        meta,
        decode_block_tables=None if bt is None else remap[bt],
        prefills=prefills,
        _prefill_desc=None,  # its tables hold the old ids
    )
    return used, remapped


# The last step's remapping: every layer of a step shares one metadata object.
_last_remap: list[tuple[AttentionMetadata, torch.Tensor, AttentionMetadata]] = []


def _remap_cached(meta: AttentionMetadata) -> tuple[torch.Tensor, AttentionMetadata]:
    if _last_remap and _last_remap[0][0] is meta:
        return _last_remap[0][1], _last_remap[0][2]
    used, remapped = _remap(meta)
    _last_remap[:] = [(meta, used, remapped)]
    return used, remapped


def dequantized_step(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float,
    v_scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The blocks this step reads, dequantized: ``(k, v, meta')``.

    Args:
        k_cache, v_cache: FP8 ``[num_blocks, block_size, num_kv_heads, head_dim]`` views
            (the same view twice for an MLA latent cache: dequantized once).
        meta: the step's metadata; k_scale / v_scale: the layer's scales.
        dtype: the compute dtype.

    Returns:
        ``k, v``: ``[num_used, block_size, num_kv_heads, head_dim]`` in ``dtype``, and
        ``meta'``: ``meta`` with block ids renumbered into them.
    """
    used, remapped = _remap_cached(meta)
    k = dequantize_kv(k_cache.index_select(0, used), k_scale, dtype)
    same = v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride()
    v = k if same and v_scale == k_scale else dequantize_kv(
        v_cache.index_select(0, used), v_scale, dtype)
    return k, v, remapped


def fp8_triton_decode_applies(
    query: torch.Tensor, meta: AttentionMetadata, softcap: float | None,
    sinks: torch.Tensor | None,
) -> bool:
    """Whether the Triton decode kernel serves this call's decode group over an FP8 cache
    in place (it upcasts the loaded bytes); else the blocks get dequantized. Not with a
    softcap or sinks, which only the explicit-score path computes."""
    if softcap or sinks is not None:
        return False
    chosen = meta.attention_backend
    return chosen is AttentionBackend.TRITON_PAGED or (
        chosen is None and backend.current().for_tensor(query) is KernelBackend.TRITON)


def paged_attention_fp8(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float,
    v_scale: float,
    compute: Callable[..., torch.Tensor],
    triton_decode: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Paged attention over an FP8 cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` in the compute dtype.
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` new tokens (compute dtype,
            already written to the cache).
        k_cache, v_cache: FP8 ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta, scale: as ``paged_attention``; k_scale / v_scale: the cache's scales.
        compute: ``compute(query, key, value, k_cache, v_cache, meta)`` attention over
            caches of the compute dtype (``paged_attention``'s chosen implementation with
            the window, softcap and sinks bound).
        triton_decode: the Triton decode kernel
            ``(q, k_cache, v_cache, block_tables, seq_lens, scale) -> out``; given, the
            decode group reads the FP8 blocks in place and only prefills are dequantized.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    dtype = query.dtype
    key = fake_quantize(key, k_scale, k_cache.dtype)
    value = key if value is key else fake_quantize(value, v_scale, v_cache.dtype)
    if triton_decode is None or not meta.num_decodes:
        k, v, remapped = dequantized_step(k_cache, v_cache, meta, k_scale, v_scale, dtype)
        return compute(query, key, value, k, v, remapped)
    # The decode group straight from the FP8 blocks: K's scale folds into the softmax
    # scale (q . (s k) = s (q . k)), V's into the output (sum p (s v) = s sum p v).
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    idx = meta.decode_token_idx
    nd = meta.num_decodes
    q = query[:nd] if idx is None else query[idx]
    o = triton_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                      scale * k_scale)
    if v_scale != 1.0:
        o = (o.float() * v_scale).to(dtype)
    if not meta.prefills:
        out = torch.empty_like(query)
    else:
        prefill_meta = dataclasses.replace(meta, num_decodes=0, decode_token_idx=None,
                                           decode_block_tables=None, decode_seq_lens=None)
        k, v, remapped = dequantized_step(k_cache, v_cache, prefill_meta, k_scale, v_scale,
                                          dtype)
        out = compute(query, key, value, k, v, remapped)
    if idx is None:
        out[:nd] = o
    else:
        out[idx] = o
    return out
