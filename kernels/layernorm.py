"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

``rms_norm_ref`` is the torch reference (the CPU path and the oracle); it follows
the Hugging Face Llama formulation exactly: normalise in float32, cast back to the
input dtype, then multiply by the weight. ``rms_norm`` is the checked wrapper,
optionally fused with the residual add that precedes every norm in a decoder layer.
"""

from __future__ import annotations

import torch


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
    if residual is None:
        return rms_norm_ref(x, weight, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
            f"got ({tuple(residual.shape)}, {residual.dtype})"
        )
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual
