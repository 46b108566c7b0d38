"""GGUF Q4_0 / Q4_1 / Q8_0 linears on integer dot products (``csrc/gguf_dot_cpu.c``).

The weight's blocks are repacked once (``pack_gguf``) so one 64-byte load holds 4 codes of
each of 16 output rows; the activations are quantized per 32-element block to int8 with a
float32 scale inside the kernel (llama.cpp's Q8 activations), and each block's products
are summed in int32 (VPDPBUSD with the codes as its unsigned operand where the CPU has
VNNI). ``gguf_dot_ref`` is the same math in float64 (the oracle); ``unpack_gguf`` gives the
file's blocks back bit for bit, so a layer keeps one copy of its weight.

Shapes: ``x [M, K]``, the weight ``[N, K]`` in blocks ``[N, K / 32 * type_size]`` uint8,
``y [M, N]``; ``K`` a multiple of 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import backend, gguf_quants
from tandem.kernels.native_abi import NativeLibrary
from tandem.kernels.quant.int8_native import prepare_rows

Q4_0, Q4_1, Q8_0 = 2, 3, 8
#: The ggml type ids the kernel runs.
DOT_TYPES = (Q4_0, Q4_1, Q8_0)
_CODE_BYTES = {Q4_0: 16, Q4_1: 16, Q8_0: 32}  # per row and block


def _lib() -> NativeLibrary | None:
    return backend.current().native()


@dataclass
class PackedGGUF:
    """A ``[n, k]`` GGUF weight in the kernel's layout.

    Attributes:
        type_id: ggml type id (``DOT_TYPES``).
        wp: ``[ceil(n / 16), k / 32, 16 * type_size]`` uint8 tiles (padding rows zero).
        n / k: the weight's shape.
    """

    type_id: int
    wp: torch.Tensor
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        """Bytes of the packed tiles."""
        return self.wp.numel()


def pack_gguf(type_id: int, raw: torch.Tensor, k: int) -> PackedGGUF | None:
    """``raw [N, K / 32 * type_size]`` uint8 blocks -> the packed layout, or ``None``
    where the native library is absent or the type is not one of ``DOT_TYPES``.

    Raises:
        ValueError: blocks of the wrong shape for ``k`` (``gguf_quants.check_blocks``).
    """
    lib = _lib()
    if lib is None or type_id not in DOT_TYPES or k % 32 or raw.shape[0] == 0:
        return None
    t = gguf_quants.gguf_type(type_id, "pack_gguf")
    n = int(raw.shape[0])
    gguf_quants.check_blocks(t, raw, n, k, "pack_gguf")
    raw = raw.contiguous()
    wp = torch.empty(((n + 15) // 16, k // 32, 16 * t.type_size), dtype=torch.uint8)
    rc = lib.gguf_pack_weight(type_id, raw.data_ptr(), n, k, wp.data_ptr())
    assert rc == 0, f"gguf_pack_weight failed with code {rc}"
    return PackedGGUF(type_id, wp, n, k)


def unpack_gguf(p: PackedGGUF, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The file's blocks of rows ``ids`` (``None``: all) back from the packed layout,
    ``[n, K / 32 * type_size]`` uint8, bit for bit (torch ops only)."""
    nq = _CODE_BYTES[p.type_id]
    rows = torch.arange(p.n) if ids is None else ids.reshape(-1).to(torch.int64)
    tiles = p.wp[rows // 16]  # [n, KB, tile]
    i = (rows % 16).view(-1, 1, 1)
    kb = tiles.shape[1]
    codes = tiles[..., : 16 * nq].reshape(len(rows), kb, nq // 4, 16, 4)
    codes = codes.gather(3, i.view(-1, 1, 1, 1, 1).expand(-1, kb, nq // 4, 1, 4))
    codes = codes.reshape(len(rows), kb, nq)
    if p.type_id == Q8_0:
        codes = codes ^ 0x80
    halves = tiles[..., 16 * nq :].reshape(len(rows), kb, -1, 16, 2)  # d (and m)
    halves = halves.gather(3, i.view(-1, 1, 1, 1, 1).expand(-1, kb, halves.shape[2], 1, 2))
    blocks = torch.cat([halves.reshape(len(rows), kb, -1), codes], dim=2)
    return blocks.reshape(len(rows), -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, in torch (float32, as the C code rounds).

    Args:
        x: ``[M, K]`` float32 / bf16, ``K % 32 == 0``.

    Returns:
        ``(xq [M, K] int8, da [M, K / 32] float32, sa [M, K / 32] int32)``: per block
        ``da = max|x| / 127``, ``xq = round_half_even(x / da)`` (0 where ``da == 0``),
        ``sa = sum(xq)``.
    """
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    da = xb.abs().amax(dim=-1) / 127.0
    safe = torch.where(da > 0, da, torch.ones_like(da))
    q = torch.where(da[..., None] > 0, torch.round(xb / safe[..., None]), 0.0).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), da, q.sum(dim=-1).to(torch.int32)


def _codes(type_id: int, raw: torch.Tensor, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(signed codes [N, KB, 32] int64, d [N, KB] float64, m [N, KB] float64 | None)``:
    ``w = d * code (+ m)``."""
    n, kb = raw.shape[0], k // 32
    b = raw.reshape(n, kb, -1)

    def half(off: int) -> torch.Tensor:
        return b[..., off : off + 2].contiguous().view(torch.float16)[..., 0].double()

    if type_id == Q8_0:
        return b[..., 2:].contiguous().view(torch.int8).long(), half(0), None
    qs = b[..., 4:] if type_id == Q4_1 else b[..., 2:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).long()
    if type_id == Q4_0:
        return codes - 8, half(0), None
    return codes, half(0), half(2)


def gguf_dot_ref(x: torch.Tensor, type_id: int, raw: torch.Tensor, k: int,
                 bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in float64: ``(y [M, N], bound [M, N])``, ``bound`` the sum of
    the absolute block terms (a float32 evaluation in any block order is within
    ``(K / 32 + 4) * 2^-23 * bound`` of ``y``).

    Args:
        x: ``[M, K]`` float; raw: ``[N, K / 32 * type_size]`` blocks of ``type_id``.
        bias: ``[N]`` or ``None``.
    """
    xq, da, sa = quantize_activations(x)
    w, d, m = _codes(type_id, raw, k)
    xb = xq.reshape(xq.shape[0], -1, 32).double()
    dot = torch.einsum("mbk,nbk->mnb", xb, w.double())  # exact: integers below 2^53
    scale = da.double()[:, None, :] * d[None]
    terms = dot * scale
    bound = terms.abs().sum(-1)
    y = terms.sum(-1)
    if m is not None:
        mt = m[None] * (da.double() * sa.double())[:, None, :]
        y = y + mt.sum(-1)
        bound = bound + mt.abs().sum(-1)
    if bias is not None:
        y = y + bias.double()
    return y, bound


def gguf_dot_linear(x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None = None,
                    path: int | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` on the native kernel, ``W`` the packed weight.

    Args:
        x: ``[..., K]`` float32 or bf16 (the output dtype; bf16 rounded to nearest even
            from the float32 sum plus bias).
        p: the packed weight; bias: ``[N]`` (added in float32) or ``None``.
        path: a kernel path (``int8_native.PATHS``) to force, e.g. in tests; ``None``:
            the best this CPU runs.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: ``x``'s last dimension is not ``K``, its dtype is not float32 / bf16,
            or ``path`` is not run here.
        RuntimeError: the native library is absent or the kernel fails (out of memory).
    """
    if x.shape[-1] != p.k or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32/bf16 [..., {p.k}], got {x.dtype} {list(x.shape)}")
    lib = _lib()
    if lib is None:
        raise RuntimeError("gguf_dot_linear needs the native kernel library")
    path, x2, y = prepare_rows(lib, x, p.k, p.n, path)
    m = x2.shape[0]
    if m == 0:
        return y.view(*x.shape[:-1], p.n)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.gguf_dot_linear(path, p.type_id, int(x.dtype == torch.bfloat16), x2.data_ptr(),
                             x2.stride(0), p.wp.data_ptr(), None if b is None else b.data_ptr(),
                             y.data_ptr(), p.n, m, p.n, p.k, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"gguf_dot_linear failed with code {rc}")
    return y.view(*x.shape[:-1], p.n)
