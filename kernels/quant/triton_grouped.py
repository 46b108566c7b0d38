"""Triton W4A16 / W8A16 GEMM over the canonical group-quantized layout (``packing.py``).

``y = x @ W.T + bias`` with ``W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g]``,
``g = k // group_size``: the contract of ``grouped.grouped_linear_reference`` (GPTQ,
arXiv:2210.17323; AWQ, arXiv:2306.00978), computed without a dequantized copy of the
weight. Each program owns a ``BLOCK_M x BLOCK_N`` output tile and walks K in
``BLOCK_K`` steps: it loads the packed bytes of a ``BLOCK_K x BLOCK_N`` weight tile,
unpacks the nibbles (or bytes) in registers, subtracts the zero points, multiplies by
the group scales in float32, rounds the tile once to the activation dtype (as the
reference's dequantization does) and accumulates ``tl.dot`` in float32. This is the
usual weight-only split of the dequantization into the GEMM's K loop (as Marlin-style
and exllama kernels do it), written for the canonical layout rather than a repacked one.

When ``BLOCK_K`` divides the group size, a K step lies inside one group and reads one
scale (and zero) per output column; otherwise (a group size that is not a multiple of
16) each element reads its own group's scale. Act-order layers gather the input columns
by their permutation before the kernel, as the reference does.

An 8-bit weight may also be signed ``int8`` (``Int8Linear``'s symmetric weights with one
group per row, ``zeros=None``): the loaded value converts to float with its sign.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

#: Activation dtypes the kernel reads and writes.
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _grouped_gemm_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, group_size,
               stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
               BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
               GROUP_TILED: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        n_mask = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_mask = kk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            if BITS == 4:
                # both nibbles of a byte are loaded by the two k that share it; the
                # second load hits the cache line the first one brought in
                byte = tl.load(q_ptr + rn[None, :] * stride_qn + kk[:, None] // 2,
                               mask=w_mask, other=0).to(tl.int32)
                w = ((byte >> ((kk[:, None] % 2) * 4)) & 0xF).to(tl.float32)
            else:
                w = tl.load(q_ptr + rn[None, :] * stride_qn + kk[:, None],
                            mask=w_mask, other=0).to(tl.float32)
            if GROUP_TILED:
                g = k0 // group_size
                if HAS_ZEROS:
                    z = tl.load(z_ptr + rn * stride_zn + g, mask=n_mask, other=0.0)
                    w = w - z.to(tl.float32)[None, :]
                s = tl.load(s_ptr + rn * stride_sn + g, mask=n_mask, other=0.0)
                w = w * s.to(tl.float32)[None, :]
            else:
                gk = kk[:, None] // group_size
                if HAS_ZEROS:
                    z = tl.load(z_ptr + rn[None, :] * stride_zn + gk, mask=w_mask, other=0.0)
                    w = w - z.to(tl.float32)
                s = tl.load(s_ptr + rn[None, :] * stride_sn + gk, mask=w_mask, other=0.0)
                w = w * s.to(tl.float32)
            w = w.to(x_ptr.dtype.element_ty)
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            b = tl.load(b_ptr + rn, mask=n_mask, other=0.0)
            acc += b.to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    return kernel


def _tiles(m: int, n: int, group_size: int) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_TILED)`` for ``m`` rows, ``n`` outputs.

    ``tl.dot`` needs every block dimension >= 16, so a decode step's few rows still
    fill a 16-row tile (masked); prefill batches take wider tiles over M.
    """
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 32 if n <= 32 else 64
    block_k = next((b for b in (64, 32, 16) if group_size % b == 0), 32)
    return block_m, block_n, block_k, group_size % block_k == 0


def _check(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
           bits: int, group_size: int, perm: torch.Tensor | None,
           bias: torch.Tensor | None) -> None:
    """The wrapper's argument checks (see ``grouped_linear_triton``)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if x.dim() < 1 or x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be [..., in] float16/bfloat16/float32, got "
                         f"{tuple(x.shape)} {x.dtype}")
    k = x.shape[-1]
    ok_q = q.dtype == torch.uint8 or (bits == 8 and q.dtype == torch.int8)
    if not ok_q or q.dim() != 2 or q.shape[1] * 8 != k * bits:
        raise ValueError(f"q must be [out, {k * bits // 8}] uint8 for {bits}-bit weights over "
                         f"{k} inputs (int8 also for 8 bits), got {tuple(q.shape)} {q.dtype}")
    n = q.shape[0]
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size {group_size} must divide the {k} inputs")
    groups = (n, k // group_size)
    if tuple(scales.shape) != groups or not scales.dtype.is_floating_point:
        raise ValueError(f"scales must be {groups} float, got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    if zeros is not None and (tuple(zeros.shape) != groups or not zeros.dtype.is_floating_point):
        raise ValueError(f"zeros must be {groups} float or None, got {tuple(zeros.shape)} "
                         f"{zeros.dtype}")
    if perm is not None and (tuple(perm.shape) != (k,) or perm.dtype != torch.int64):
        raise ValueError(f"perm must be [{k}] int64 or None, got {tuple(perm.shape)} {perm.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}] or None, got {tuple(bias.shape)}")
    named = {"q": q, "scales": scales, "zeros": zeros, "perm": perm, "bias": bias}
    for name, t in named.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


def grouped_linear_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` on the Triton kernel; the contract of
    ``grouped.grouped_linear_reference`` (float32 accumulation, another summation order).

    Args:
        x: ``[..., in]`` float16 / bfloat16 / float32.
        q: canonical ``[out, in / 2]`` uint8 (4 bits) or ``[out, in]`` uint8 / int8
            (8 bits).
        scales: ``[out, in / group_size]`` float (any float dtype; used in float32).
        zeros: ``[out, in / group_size]`` float zero points in units of ``q``, or ``None``.
        bits: 4 or 8.
        group_size: input columns per group; divides ``in``.
        perm: ``[in]`` int64 act-order permutation (``x[..., perm]`` meets the sorted
            columns), or ``None``.
        bias: ``[out]`` or ``None``; added in float32 before the output is rounded.

    Returns:
        ``[..., out]`` in ``x.dtype``.

    Raises:
        ValueError: naming the argument whose shape, dtype or device does not fit.
    """
    import triton

    _check(x, q, scales, zeros, bits, group_size, perm, bias)
    k = x.shape[-1]
    n = q.shape[0]
    x2 = x.reshape(-1, k)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    q, scales = q.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    block_m, block_n, block_k, tiled = _tiles(m, n, group_size)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _grouped_gemm_kernel()[grid](
        x2, q, scales, scales if zeros is None else zeros, scales if bias is None else bias,
        out, m, n, k, group_size,
        x2.stride(0), q.stride(0), scales.stride(0), 0 if zeros is None else zeros.stride(0),
        out.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        GROUP_TILED=tiled, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.view(*x.shape[:-1], n)


def int8_weight_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` on the grouped kernel: ``Int8Linear``'s
    symmetric per-row int8 weights as one group per row, weight-only (W8A16).

    NOTE: the CPU path quantizes the activations per token (W8A8,
    ``grouped.int8_rowwise_linear``); on a GPU the activations stay in their dtype, so
    the result is the dequantized weight's product without the activation rounding.

    Args:
        x: ``[..., in]`` float16 / bfloat16 / float32.
        q: ``[out, in]`` int8.
        scale: ``[out]`` float32.
        bias: ``[out]`` or ``None``.

    Returns:
        ``[..., out]`` in ``x.dtype``.

    Raises:
        ValueError: naming the argument that does not fit (``grouped_linear_triton``).
    """
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q must be [out, in] int8, got {tuple(q.shape)} {q.dtype}")
    return grouped_linear_triton(x, q, scale.reshape(-1, 1), None, 8, q.shape[1], None, bias)
