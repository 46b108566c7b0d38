"""Native CPU kernels (``kernels/csrc/*.c``): the op wrappers over the loaded library.

Kernels: paged decode attention, bf16 prefill attention, fused residual add +
RMSNorm, rotary embedding, SiLU-and-multiply, the cache write, row argmax, and
bf16 linear layers on packed weights (the bf16 kernels on AMX tiles where the
CPU has them, else AVX512-BF16). Each wrapper declines (``supports`` is False or
it returns ``None``) where it cannot serve the tensors, and the torch reference
runs.

Why a C kernel: paged decode attention is memory bound, and the torch path has to
gather every context block into a padded copy before SDPA can run (see
``kernels/attention.py``); ``paged_decode_attention_cpu`` reads K/V in place.

Which build of the library runs (one per ISA variant, ``kernels/native_build.py``)
and whether one runs at all is decided by ``kernels/backend.py``; the functions
and their argument lists come from ``csrc/tandem_kernels.h``
(``kernels/native_abi.py``).

The wrappers live by family: ``cpu_attention.py`` (decode and prefill attention),
``cpu_linear.py`` (packed bf16 linear layers), ``cpu_sampling.py`` (argmax and the
exponential race), the elementwise ones here; the library, its limits and what the
wrappers share in ``cpu_native.py``. This module names them all, as their callers
use them (``cpu_ext.<op>``).
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu_attention import (
    paged_decode_attention_cpu,
    prefill_attention_cpu,
    prefill_attention_supports,
    supports,
)
from tandem.kernels.cpu_linear import (
    LINEAR_BF16,
    LINEAR_FMA,
    LINEAR_NONE,
    bf16_linear,
    bf16_linear_argmax,
    bf16_linear_available,
    bf16_linear_path,
    bf16_linear_supports,
    bf16_linear_swiglu,
    bf16_pack_weight,
)
from tandem.kernels.cpu_native import (
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    VECTOR_WIDTH,
    amx_available,
    elementwise_ok,
    load,
    threads_for,
)
from tandem.kernels.cpu_sampling import (
    RACE_MIN_EXPONENT,
    argmax_rows_cpu,
    check_row_vectors,
    race_logits_rows_cpu,
    race_noise_cpu,
    race_rows_cpu,
)

__all__ = [
    "LINEAR_BF16",
    "LINEAR_FMA",
    "LINEAR_NONE",
    "MAX_GROUP",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_HIDDEN",
    "RACE_MIN_EXPONENT",
    "VECTOR_WIDTH",
    "add_rms_norm_cpu",
    "amx_available",
    "argmax_rows_cpu",
    "bf16_linear",
    "bf16_linear_argmax",
    "bf16_linear_available",
    "bf16_linear_path",
    "bf16_linear_supports",
    "bf16_linear_swiglu",
    "bf16_pack_weight",
    "cache_write_cpu",
    "check_row_vectors",
    "load",
    "paged_decode_attention_cpu",
    "prefill_attention_cpu",
    "prefill_attention_supports",
    "race_logits_rows_cpu",
    "race_noise_cpu",
    "race_rows_cpu",
    "rotary_neox_cpu",
    "silu_and_mul_cpu",
    "supports",
]


def add_rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Fused ``residual add + RMSNorm`` (see ``kernels/layernorm.py`` for the math).

    Args:
        x: ``[..., hidden]`` bfloat16 (float32 is declined); weight ``[hidden]``;
            residual like ``x``.

    Returns:
        ``normed`` (no residual) or ``(normed, x + residual)``, new contiguous
        tensors; ``None`` when the native path cannot serve these tensors (the
        caller then runs the torch reference).
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    # bf16 only: in float32 the torch path is kept bit-identical to
    # transformers (the token-for-token oracle); a C sum runs in another order.
    if x.dtype != torch.bfloat16 or not elementwise_ok(*tensors) or not x.is_contiguous():
        return None
    if x.shape[-1] > MAX_HIDDEN:
        return None
    if residual is not None and not residual.is_contiguous():
        return None
    lib = load()
    assert lib is not None
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    lib.add_rms_norm(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        res_out.data_ptr() if res_out is not None else None,
        x.numel() // hidden if hidden else 0,
        hidden,
        float(eps),
        threads_for(x.numel()),
    )
    return out if res_out is None else (out, res_out)


def rotary_neox_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of ``x: [T, H, D]`` (head dim contiguous, any token/head
    strides) by ``cos, sin: [T, 1, D/2]``; a new contiguous ``[T, H, D]``, or
    ``None`` when the native path cannot serve these tensors."""
    if not elementwise_ok(x, cos, sin) or x.stride(-1) != 1:
        return None
    lib = load()
    assert lib is not None
    tokens, heads, head_dim = x.shape
    cos = cos.reshape(tokens, head_dim // 2).contiguous()
    sin = sin.reshape(tokens, head_dim // 2).contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    lib.rotary_neox(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        out.data_ptr(),
        tokens,
        heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        threads_for(out.numel()),
    )
    return out


def cache_write_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Native ``reshape_and_cache``: copy ``key/value [T, H, D]`` rows (head dim
    contiguous, any token/head strides) into the cache slots ``slot_mapping``
    (``[T]`` int64, ``block * block_size + offset``) of ``k_cache/v_cache``
    (``[blocks, block_size, H, D]`` views, head dim contiguous). Exact copies.

    Returns whether it ran (False: not servable here, use the torch path).
    """
    if not elementwise_ok(key, value, k_cache, v_cache):
        return False
    if not (key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1):
        return False
    if not slot_mapping.is_contiguous():
        return False
    lib = load()
    assert lib is not None
    tokens, heads, head_dim = key.shape
    lib.cache_write(
        key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slot_mapping.data_ptr(), tokens, heads, head_dim, k_cache.shape[1],
        key.element_size(), threads_for(2 * key.numel()),
    )  # fmt: skip
    return True


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``x = [T, 2 * I]`` holding ``gate | up`` (SwiGLU,
    Shazeer 2020); ``[T, I]`` bfloat16, or ``None`` when the native path cannot
    serve ``x`` (float32 is declined, see ``add_rms_norm_cpu``)."""
    if x.dtype != torch.bfloat16 or not elementwise_ok(x) or x.dim() != 2:
        return None  # float32: torch's exp, as transformers computes it
    if not x.is_contiguous() or x.shape[1] % 2:
        return None
    lib = load()
    assert lib is not None
    tokens, two_inter = x.shape
    out = torch.empty((tokens, two_inter // 2), dtype=x.dtype)
    lib.silu_and_mul(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        out.data_ptr(),
        tokens,
        two_inter // 2,
        threads_for(x.numel()),
    )
    return out
