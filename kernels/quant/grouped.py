"""Linears over group-quantized integer weights in the canonical layout (``packing.py``).

``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]`` with ``g = k // group_size``
(GPTQ, Frantar et al. 2022, arXiv:2210.17323; AWQ, Lin et al. 2023, arXiv:2306.00978;
compressed-tensors' group/channel strategies all reduce to this after repacking). An
act-order checkpoint (GPTQ ``desc_act``, ``g_idx``) is repacked with its input columns
sorted by group, and the input is gathered by the same permutation (exllama's trick),
so the groups here are always contiguous.

``grouped_linear_reference`` is the torch path every method falls back to: it
dequantizes ``TILE_ROWS`` output rows at a time into the compute dtype and multiplies,
so no dequantized copy of the whole weight is ever resident.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.quant.packing import from_canonical

#: Output rows dequantized per step of the reference path: 512 x 4096 bf16 = 4 MiB.
TILE_ROWS = 512


def dequantize_rows(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    rows: slice,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows ``rows`` of the dequantized weight.

    Args:
        q: canonical uint8 ``[out, in]`` (8 bits) or ``[out, in / 2]`` (4 bits).
        scales: ``[out, in / group_size]`` float.
        zeros: ``[out, in / group_size]`` float32 zero points in units of ``q``, or
            ``None`` (symmetric: the values are already signed, see ``signed``).
        bits / group_size: of the layout.
        rows / dtype: which output rows, and the dtype of the result.

    Returns:
        ``[len(rows), in]`` in ``dtype``; computed in float32, rounded once.
    """
    vals = from_canonical(q[rows], bits).float()
    r, k = vals.shape
    vals = vals.view(r, k // group_size, group_size)
    if zeros is not None:
        vals = vals - zeros[rows].float().unsqueeze(-1)
    return (vals * scales[rows].float().unsqueeze(-1)).reshape(r, k).to(dtype)


def grouped_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` as in the module docstring, tile by tile.

    Args:
        x: ``[..., in]`` in the compute dtype.
        q / scales / zeros / bits / group_size: see ``dequantize_rows``.
        perm: ``[in]`` int64 input permutation of an act-order layout (``x[..., perm]``
            meets the sorted columns), or ``None``.
        bias: ``[out]`` or ``None``.

    Returns:
        ``[..., out]`` in ``x.dtype``.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    n = scales.shape[0]
    out = x2.new_empty((x2.shape[0], n))
    for start in range(0, n, TILE_ROWS):
        rows = slice(start, min(start + TILE_ROWS, n))
        w = dequantize_rows(q, scales, zeros, bits, group_size, rows, x2.dtype)
        out[:, rows] = F.linear(x2, w)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.view(*x.shape[:-1], n)


def int8_rowwise_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """W8A8 with dynamic per-token activation scales (compressed-tensors
    ``int-quantized``, ``input_activations: {dynamic: true, strategy: token}``):
    ``y[m, n] = (sum_k xq[m, k] q[n, k]) * sx[m] * s[n]`` with ``xq = round(x / sx)``,
    ``sx = max|x[m]| / 127``, accumulated in int32 by ``torch._int_mm``.

    Args:
        x: ``[..., in]`` float.
        q: ``[out, in]`` int8 (symmetric).
        scales: ``[out]`` float32.
        bias: ``[out]`` or ``None``.

    Returns:
        ``[..., out]`` in ``x.dtype``.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    sx = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    xq = torch.round(x2 / sx).clamp_(-128, 127).to(torch.int8)
    acc = torch._int_mm(xq, q.t())
    out = acc.float() * sx * scales.float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def w4a8_group_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """W4A8, on-load int4's numerics: symmetric 4-bit weights per group of inputs, int8
    activations quantized per token as ``int8_rowwise_linear`` does, exact integer dot
    products per group, each scaled by its group's weight scale and summed over the
    groups in order in float32, then scaled by the token's scale:
    ``y[m, n] = (sum_g acc[m, n, g] * s[n, g]) * sx[m] (+ bias[n])`` with
    ``acc[m, n, g] = sum_{k in g} xq[m, k] (v[n, k] - 8)``. The native kernel
    (``kernels/csrc/int4_linear_cpu.c``) equals this bit for bit.

    Args:
        x: ``[..., in]`` float.
        q: canonical 4-bit ``[out, in / 2]`` uint8 (``packing.to_canonical``), values
            ``v`` in ``0..15`` around the zero point 8.
        scales: ``[out, in / group_size]`` float (used as float32).
        group_size: inputs per group, dividing ``in``.
        bias: ``[out]`` or ``None`` (added in float32).

    Returns:
        ``[..., out]`` in ``x.dtype``.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    m, n, groups = x2.shape[0], q.shape[0], k // group_size
    sx = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    xq = torch.round(x2 / sx).clamp_(-128, 127)
    # NOTE: float32 products and sums of these integers are exact (|acc| <= 2**17 <
    # 2**24 for a group of at most 128), so the batched matmul gives the int32 sums.
    xg = xq.view(m, groups, group_size).transpose(0, 1)
    s = scales.float()
    out = x2.new_empty((m, n))
    for start in range(0, n, TILE_ROWS):
        rows = slice(start, min(start + TILE_ROWS, n))
        w = (from_canonical(q[rows], 4) - 8).float()
        wg = w.view(-1, groups, group_size).permute(1, 2, 0)
        acc = torch.bmm(xg, wg)  # [groups, m, rows]
        f = torch.zeros((m, w.shape[0]))
        for g in range(groups):
            f = f + acc[g] * s[rows, g]
        out[:, rows] = f
    out = out * sx
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], n)
