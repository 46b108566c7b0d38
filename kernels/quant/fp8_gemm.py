"""FP8 (E4M3) weight GEMMs on GPUs with FP8 tensor cores, through ``torch._scaled_mm``.

``torch._scaled_mm`` is the documented FP8 GEMM entry point (vLLM's ``w8a8_utils``
calls it too): ``a [M, K]`` row-major FP8 times ``b [K, N]`` column-major FP8, each with
a float32 scale, accumulated in float32. The activations are quantized here, dynamically:
``sx[m] = max|x[m]| / 448`` per token, ``xq = x / sx`` rounded to E4M3 (W8A8 FP8, as
vLLM's dynamic per-token activation scheme). Weight scales are per output row (per-tensor
scales of fused parts are expanded per row by ``Fp8Linear``), so the product needs an
outer product of the two scale vectors:

* ``ROWWISE``: ``_scaled_mm``'s own row-wise scaling (``scale_a [M, 1]``, ``scale_b
  [1, N]``), fused into the GEMM; torch offers it on compute capability 9.0 and later
  with a bfloat16 output.
* ``EPILOGUE``: ``_scaled_mm`` with unit tensor-wise scales to a float32 output, then
  ``* sx[m] * s[n]`` (and the bias) in one elementwise pass, on FP8 GPUs where the
  row-wise form is not offered (capability 8.9, or a float16 / float32 output).
* ``DEQUANT``: no FP8 GEMM (older GPUs, block-scaled weights, a K or N that is not a
  multiple of 16): ``Fp8Linear`` dequantizes the weight to the compute dtype.

``fp8_gemm_path`` makes that choice from the capability it is given, so the rule is
testable without the GPU.
"""

from __future__ import annotations

import enum
import functools

import torch

#: The first compute capability with FP8 tensor cores (Ada Lovelace; Hopper is 9.0).
FP8_MIN_CAPABILITY = (8, 9)
#: The first compute capability where ``_scaled_mm`` scales row-wise.
ROWWISE_MIN_CAPABILITY = (9, 0)
#: ``_scaled_mm`` needs K and N to be multiples of this.
SCALED_MM_ALIGN = 16
#: Largest finite E4M3 value: the activation scale maps each token's max onto it.
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


class Fp8Path(enum.Enum):
    """How an FP8 layer computes on a GPU (the module docstring describes each)."""

    ROWWISE = "rowwise"
    EPILOGUE = "epilogue"
    DEQUANT = "dequant"


def fp8_gemm_path(capability: tuple[int, int] | None, out_dtype: torch.dtype, n: int, k: int,
                  block_scaled: bool = False) -> Fp8Path:
    """Choose how an FP8 weight ``[n, k]`` computes on a GPU.

    Args:
        capability: the GPU's ``(major, minor)`` compute capability; ``None`` for a
            device without one (the CPU), which always dequantizes.
        out_dtype: the activation (and output) dtype.
        n / k: the weight's output and input sizes.
        block_scaled: whether the weight has 2-D block scales (``weight_block_size``),
            which these paths do not apply.

    Returns:
        ``ROWWISE`` from capability 9.0 with a bfloat16 output, ``EPILOGUE`` from 8.9
        otherwise, ``DEQUANT`` below 8.9, for block scales, or when ``n`` or ``k`` is not
        a multiple of ``SCALED_MM_ALIGN``.
    """
    if capability is None or tuple(capability) < FP8_MIN_CAPABILITY or block_scaled:
        return Fp8Path.DEQUANT
    if n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN:
        return Fp8Path.DEQUANT
    if tuple(capability) >= ROWWISE_MIN_CAPABILITY and out_dtype == torch.bfloat16:
        return Fp8Path.ROWWISE
    return Fp8Path.EPILOGUE


@functools.cache
def cuda_capability(index: int) -> tuple[int, int]:
    """CUDA device ``index``'s compute capability (asked once per device)."""
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` float -> ``(xq [M, K] float8_e4m3fn, sx [M, 1] float32)`` with
    ``x ~= xq * sx``; ``sx = max|x[m]| / E4M3_MAX`` (an all-zero row gets a tiny scale)."""
    xf = x.float()
    sx = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    xq = (xf / sx).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return xq, sx


def fp8_scaled_mm_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None, path: Fp8Path) -> torch.Tensor:
    """``x @ (w8 * scale[:, None]).T + bias`` with FP8 activations, on ``_scaled_mm``.

    Args:
        x: ``[..., K]`` float16 / bfloat16 / float32 (quantized per token inside).
        w8: ``[N, K]`` float8_e4m3fn, contiguous (its transpose is the column-major
            operand ``_scaled_mm`` wants).
        scale: ``[N]`` float32 weight scale per output row.
        bias: ``[N]`` or ``None``.
        path: ``ROWWISE`` or ``EPILOGUE`` (``fp8_gemm_path``).

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: naming the argument: a shape or dtype that does not fit, or
            ``path`` ``DEQUANT`` (that path is the caller's own).
    """
    k = x.shape[-1]
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2 or w8.shape[1] != k:
        raise ValueError(f"w8 must be [N, {k}] float8_e4m3fn, got {tuple(w8.shape)} {w8.dtype}")
    n = w8.shape[0]
    if tuple(scale.shape) != (n,):
        raise ValueError(f"scale must be [{n}], got {tuple(scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}] or None, got {tuple(bias.shape)}")
    if path is Fp8Path.DEQUANT:
        raise ValueError("path DEQUANT has no _scaled_mm form")
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    xq, sx = quantize_fp8_per_token(x2)
    wt = w8.contiguous().t()
    s = scale.float().reshape(1, n)
    if path is Fp8Path.ROWWISE:
        out = torch._scaled_mm(xq, wt, scale_a=sx, scale_b=s.contiguous(),
                               out_dtype=torch.bfloat16)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.to(x.dtype).view(*x.shape[:-1], n)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    acc = torch._scaled_mm(xq, wt, scale_a=one, scale_b=one, out_dtype=torch.float32)
    acc = acc * sx * s
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).view(*x.shape[:-1], n)
