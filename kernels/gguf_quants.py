"""GGUF (ggml) block-quantized weight formats: their layouts and a torch reference unpacking.

A quantized ``[rows, K]`` matrix is stored row by row; each row is ``K / block`` blocks of
``type_size`` bytes. The layouts are ggml's (``ggml/src/ggml-common.h``, ``block_q4_0`` ...
``block_q6_K``), all little-endian, ``d``/``m``/``dmin`` IEEE half precision:

====== ===== ===== ==================================================================
type   block bytes layout -> value of element ``i``
====== ===== ===== ==================================================================
Q4_0   32    18    ``d, qs[16]``: ``q = qs[i] & 15`` (i < 16) / ``qs[i-16] >> 4``;
                   ``w = d * (q - 8)``
Q4_1   32    20    ``d, m, qs[16]`` (nibbles as Q4_0): ``w = d * q + m``
Q5_0   32    22    ``d, qh (u32), qs[16]``: 5th bit ``(qh >> i) & 1``; ``w = d * (q - 16)``
Q5_1   32    24    ``d, m, qh, qs[16]``: ``w = d * q + m``
Q8_0   32    34    ``d, qs[32] (int8)``: ``w = d * qs[i]``
Q4_K   256   144   ``d, dmin, scales[12], qs[128]``: 8 sub-blocks of 32 with 6-bit scale
                   ``sc`` and min ``mn`` packed in ``scales``; 64-element groups take the
                   low then the high nibbles of 32 bytes; ``w = d*sc * q - dmin*mn``
Q5_K   256   176   ``d, dmin, scales[12], qh[32], qs[128]``: as Q4_K plus bit ``j`` of
                   ``qh[l]`` as the 5th bit of sub-block ``j``'s element ``l``
Q6_K   256   210   ``ql[128], qh[64], scales[16] (int8), d``: 16 sub-blocks of 16, 4 low
                   bits from ``ql`` and 2 high from ``qh``; ``w = d*scales[s] * (q - 32)``
====== ===== ===== ==================================================================

``dequantize`` follows the ``gguf`` package's numpy reference (``gguf.quants``) step by
step in float32, so its output equals ``gguf.quants.dequantize`` bit for bit; it is the
oracle of the native kernels (``kernels/csrc/gguf_quant_cpu.c``) and their fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GGUFType:
    """One ggml quantization type: its ggml id (``GGMLQuantizationType``), elements per
    block and bytes per block."""

    name: str
    type_id: int
    block: int
    type_size: int


GGUF_TYPES: dict[int, GGUFType] = {
    t.type_id: t
    for t in (
        GGUFType("Q4_0", 2, 32, 18),
        GGUFType("Q4_1", 3, 32, 20),
        GGUFType("Q5_0", 6, 32, 22),
        GGUFType("Q5_1", 7, 32, 24),
        GGUFType("Q8_0", 8, 32, 34),
        GGUFType("Q4_K", 12, 256, 144),
        GGUFType("Q5_K", 13, 256, 176),
        GGUFType("Q6_K", 14, 256, 210),
    )
}
BY_NAME = {t.name: t for t in GGUF_TYPES.values()}


def gguf_type(type_id: int, what: str = "tensor") -> GGUFType:
    """The ``GGUFType`` of a ggml type id.

    Raises:
        ValueError: naming ``what`` (e.g. the tensor) and the id when the type is not one
            of the quantized types above.
    """
    t = GGUF_TYPES.get(int(type_id))
    if t is None:
        names = ", ".join(t.name for t in GGUF_TYPES.values())
        raise ValueError(f"{what}: GGUF quantization type {int(type_id)} is not supported "
                         f"(supported: {names}, F32, F16, BF16)")
    return t


def check_blocks(t: GGUFType, raw: torch.Tensor, rows: int, cols: int, what: str) -> None:
    """Check that ``raw`` holds a ``[rows, cols]`` matrix of type ``t``.

    Raises:
        ValueError: naming ``what`` when ``raw`` is not uint8 ``[rows, cols / block *
            type_size]`` or ``cols`` is not a multiple of the block size.
    """
    if cols % t.block:
        raise ValueError(f"{what}: {t.name} rows of {cols} elements are not whole blocks "
                         f"of {t.block}")
    want = (rows, cols // t.block * t.type_size)
    if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
        raise ValueError(f"{what}: {t.name} [{rows}, {cols}] needs uint8 blocks of shape "
                         f"{list(want)}, got {raw.dtype} {list(raw.shape)} (corrupted tensor?)")


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` uint8 little-endian halves -> ``[n, 1]`` float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """``[n, g * group]`` bytes -> ``[n, g * 2 * group]``: per ``group`` bytes, the low
    nibbles then the high nibbles (ggml's order in every 4-bit format)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group)
    return torch.cat([q & 15, q >> 4], dim=2).reshape(n, -1)


def _bits(word: torch.Tensor, count: int) -> torch.Tensor:
    """``[n]`` int64 -> ``[n, count]`` its low bits, bit ``i`` at column ``i``."""
    shifts = torch.arange(count, dtype=torch.int64)
    return (word.unsqueeze(1) >> shifts) & 1


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K ``scales[12]`` -> 8 six-bit scales and 8 mins (ggml's
    ``get_scale_min_k4``), as float32 ``[n, 8]``."""
    s = scales.to(torch.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _dequant_blocks(t: GGUFType, b: torch.Tensor) -> torch.Tensor:
    """``[n, type_size]`` uint8 blocks -> ``[n, block]`` float32 (gguf.quants' steps)."""
    n = b.shape[0]
    if t.name == "Q8_0":
        return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])
    if t.name in ("Q4_0", "Q4_1"):
        off = 2 if t.name == "Q4_0" else 4
        q = _nibbles(b[:, off:], 16).float()
        if t.name == "Q4_0":
            return _f16(b[:, :2]) * (q - 8)
        return _f16(b[:, :2]) * q + _f16(b[:, 2:4])
    if t.name in ("Q5_0", "Q5_1"):
        off = 2 if t.name == "Q5_0" else 4
        qh = b[:, off : off + 4].contiguous().view(torch.int32).to(torch.int64).reshape(n)
        qh = qh & 0xFFFFFFFF
        q = (_nibbles(b[:, off + 4 :], 16).to(torch.int64) | (_bits(qh, 32) << 4)).float()
        if t.name == "Q5_0":
            return _f16(b[:, :2]) * (q - 16)
        return _f16(b[:, :2]) * q + _f16(b[:, 2:4])
    if t.name in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[:, 4:16])
        d = (_f16(b[:, :2]) * sc).unsqueeze(-1)
        dm = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
        if t.name == "Q4_K":
            q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).float()
        else:
            ql = _nibbles(b[:, 48:], 32).reshape(n, 8, 32)
            shifts = torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
            qh = (b[:, 16:48].reshape(n, 1, 32) >> shifts) & 1
            q = (ql | (qh << 4)).float()
        return (d * q - dm).reshape(n, 256)
    if t.name == "Q6_K":
        ql = _nibbles(b[:, :128], 64).reshape(n, -1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        qh = ((b[:, 128:192].reshape(n, -1, 1, 32) >> shifts) & 3).reshape(n, -1, 32)
        q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
        return (d * q).reshape(n, 256)
    raise AssertionError(t.name)


def dequantize(type_id: int, raw: torch.Tensor, cols: int, what: str = "tensor") -> torch.Tensor:
    """Unpack GGUF blocks to float32 (reference; equals ``gguf.quants.dequantize``).

    Args:
        type_id: the ggml type id (``GGUF_TYPES``).
        raw: ``[rows, cols / block * type_size]`` uint8, the rows' blocks (a GGUF
            tensor's data as ``gguf.GGUFReader`` gives it).
        cols: elements per row (a multiple of the type's block size).
        what: the tensor's name for error messages.

    Returns:
        ``[rows, cols]`` float32.

    Raises:
        ValueError: an unknown type or blocks of the wrong shape, naming ``what``.
    """
    t = gguf_type(type_id, what)
    rows = raw.shape[0] if raw.dim() == 2 else 0
    check_blocks(t, raw, rows, cols, what)
    blocks = raw.reshape(-1, t.type_size)
    return _dequant_blocks(t, blocks).reshape(rows, cols)
