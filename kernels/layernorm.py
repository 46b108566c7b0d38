"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

``rms_norm_ref`` is the torch reference (the CPU path and the oracle); it follows
the Hugging Face Llama formulation exactly: normalise in float32, cast back to the
input dtype, then multiply by the weight. ``rms_norm_triton`` is the GPU kernel (one
program per row). ``rms_norm`` is the checked wrapper, optionally fused with the
residual add that precedes every norm in a decoder layer; on the CPU it runs the
fused native kernel (``kernels/cpu_ext.py``) where one could be built.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tandem.kernels import backend, cpu_ext
from tandem.kernels.backend import KernelBackend


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dimension.

    Args:
        x: ``[..., hidden]`` float32 / bfloat16 / float16.
        weight: ``[hidden]`` same dtype as ``x``.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``[..., hidden]`` in ``x.dtype``: ``weight * (x / sqrt(mean(x^2) + eps))``,
        the normalisation computed in float32 (as transformers' ``LlamaRMSNorm``).
    """
    dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(dtype)


@functools.cache
def _rms_norm_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        y = (xf * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * stride_out + cols, w * y, mask=mask)

    return kernel


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm, same contract as ``rms_norm_ref`` (float32 accumulation)."""
    import triton

    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel()[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.stride(0),
            out.stride(0),
            hidden,
            eps,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add.

    Args:
        x: ``[num_tokens, hidden]`` (any leading dims allowed).
        weight: ``[hidden]``, same dtype as ``x``.
        eps: epsilon of the norm.
        residual: ``None``, or a tensor shaped like ``x``; then ``x + residual``
            is normalised and also returned as the new residual stream.

    Returns:
        ``normed`` when ``residual`` is ``None``, else ``(normed, x + residual)``.

    Raises:
        ValueError: when the shapes or dtypes do not match.
    """
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"weight must be [hidden={x.shape[-1]}], got {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} != weight dtype {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got ({tuple(residual.shape)}, {residual.dtype})"
        )
    kind = backend.current().for_tensor(x)
    if kind is KernelBackend.CPU_NATIVE:
        fused = cpu_ext.add_rms_norm_cpu(x, weight, eps, residual)
        if fused is not None:
            return fused
    impl = rms_norm_triton if kind is KernelBackend.TRITON else rms_norm_ref
    if residual is None:
        return impl(x, weight, eps)
    residual = x + residual
    return impl(residual, weight, eps), residual
