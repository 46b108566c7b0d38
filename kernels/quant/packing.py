"""Bit packing of integer weights into int32 words, as the checkpoint formats store them.

Every format packs ``32 // bits`` unsigned values into one int32, the first value in the
lowest bits (AutoGPTQ/GPTQModel ``pack``; compressed-tensors ``pack_to_int32``), along
one axis of the tensor: GPTQ's ``qweight [in / pack, out]`` along the input axis (0), its
``qzeros [groups, out / pack]`` along the output axis (1); AWQ's ``qweight [in, out / 8]``
and ``qzeros`` along the output axis with the columns of each word in the interleaved
order ``AWQ_ORDER`` (AutoAWQ ``WQLinear_GEMM.from_linear``); compressed-tensors'
``weight_packed [out, in / pack]`` along the input axis.

Canonical layout (what every integer method is repacked into once at load, read by
``grouped.py``): ``[out, in]`` uint8 values for 8 bits, ``[out, in / 2]`` uint8 for 4 bits
(value ``2k`` in the low nibble of byte ``k``, ``2k + 1`` in the high one).
"""

from __future__ import annotations

import torch

#: AWQ's GEMM packing: nibble ``i`` of a word holds column ``AWQ_ORDER[i]`` of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: ... so column ``j`` of the 8 sits in nibble ``AWQ_REVERSE_ORDER[j]``.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _check_bits(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8 to pack into int32 words, got {bits}")
    return 32 // bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values of int32 words, unpacked along ``dim``.

    Args:
        packed: int32 tensor; along ``dim`` each word holds ``32 // bits`` values.
        bits: 2, 4 or 8.
        dim: the packed axis (0 or 1 of a 2-D tensor, or negative).

    Returns:
        int32 tensor, ``dim`` ``32 // bits`` times longer, values in ``[0, 2**bits)``;
        value ``j`` of a word comes from bits ``[j * bits, (j + 1) * bits)``.

    Raises:
        ValueError: ``packed`` not int32, or unsupported ``bits``.
    """
    per = _check_bits(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    x = packed.unsqueeze(dim + 1)
    view = [1] * x.dim()
    view[dim + 1] = per
    vals = (x >> shifts.view(view)) & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= per
    return vals.reshape(shape)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``unpack_int32``: ``values`` (integers in ``[0, 2**bits)``) packed
    along ``dim``, whose length must be a multiple of ``32 // bits``.

    Raises:
        ValueError: unsupported ``bits``, a length that does not divide, or values
            out of range.
    """
    per = _check_bits(bits)
    dim = dim % values.dim()
    if values.shape[dim] % per:
        raise ValueError(f"axis {dim} of length {values.shape[dim]} does not pack by {per}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"values outside [0, {1 << bits}) cannot pack into {bits} bits")
    shape = list(v.shape)
    shape[dim] //= per
    shape.insert(dim + 1, per)
    v = v.reshape(shape)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=v.device)
    view = [1] * v.dim()
    view[dim + 1] = per
    word = (v << shifts.view(view)).sum(dim + 1)
    # two's complement: words >= 2**31 wrap to negative int32, as the formats store them
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def awq_unpack(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ GEMM ``[rows, cols / 8]`` int32 -> ``[rows, cols]`` int32 values in column
    order (undoing ``AWQ_ORDER``)."""
    vals = unpack_int32(packed, bits, 1)
    rows, cols = vals.shape
    order = torch.tensor(AWQ_REVERSE_ORDER, device=vals.device)
    return vals.view(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


def awq_pack(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ GEMM packing of ``[rows, cols]`` values (inverse of ``awq_unpack``)."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_ORDER, device=values.device)
    return pack_int32(values.view(rows, cols // 8, 8)[:, :, order].reshape(rows, cols), bits, 1)


def to_canonical(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[out, in]`` unsigned values -> the canonical uint8 layout (module docstring).

    Raises:
        ValueError: ``bits`` not 4 or 8, or an odd ``in`` with 4 bits.
    """
    v = values.to(torch.int32)
    if bits == 8:
        return v.to(torch.uint8).contiguous()
    if bits != 4:
        raise ValueError(f"the canonical layout holds 4- or 8-bit values, got {bits}")
    if v.shape[1] % 2:
        raise ValueError(f"4-bit weights need an even input size, got {v.shape[1]}")
    return (v[:, 0::2] | (v[:, 1::2] << 4)).to(torch.uint8).contiguous()


def from_canonical(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Canonical uint8 rows -> ``[rows, in]`` int32 values (inverse of ``to_canonical``)."""
    if bits == 8:
        return q.to(torch.int32)
    lo = (q & 0xF).to(torch.int32)
    hi = (q >> 4).to(torch.int32)
    return torch.stack((lo, hi), dim=-1).reshape(q.shape[0], -1)
