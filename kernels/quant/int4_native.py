"""W4A8 linear on the native kernel (``kernels/csrc/int4_linear_cpu.c``): 4-bit weights
per group of inputs (on-load int4), activations quantized per token inside the kernel,
int32 dot products per group (VPDPBUSD on CPUs with VNNI), equal to
``grouped.w4a8_group_linear``.

The weight is repacked once (``pack_int4``, torch ops) from the canonical layout of
``packing.py`` into the kernel's: 16 output channels x 8 inputs per 64 bytes (inputs
``j`` and ``4 + j`` of the 8 in the low and high nibble of one byte), output channels
zero-padded to 16, and the scales as ``[ceil(N / 16), groups, 16]`` float32.
``unpack_int4`` recovers the canonical ``q``, so a layer keeps one copy of its weight and
can still run the torch reference when the native library is absent. The kernel paths
are the W8A8 kernel's (``int8_native.PATHS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import backend
from tandem.kernels.native_abi import NativeLibrary
from tandem.kernels.quant.grouped import w4a8_group_linear
from tandem.kernels.quant.int8_native import prepare_rows


def _lib() -> NativeLibrary | None:
    return backend.current().native()


@dataclass
class PackedInt4:
    """A ``[N, K]`` 4-bit group-quantized weight in the kernel's layout.

    Attributes:
        wp: ``[ceil(N / 16) * K / 8 * 64]`` uint8, the packed nibbles.
        ws: ``[ceil(N / 16) * K / group_size * 16]`` float32 scales (0 on padding rows).
        n / k / group_size: the weight's shape and its group size.
    """

    wp: torch.Tensor
    ws: torch.Tensor
    n: int
    k: int
    group_size: int


def _check(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    if q.dtype != torch.uint8 or q.dim() != 2 or q.device.type != "cpu":
        raise ValueError(f"q must be a 2-D uint8 CPU tensor, got {q.dtype} "
                         f"{list(q.shape)} on {q.device}")
    n, k = q.shape[0], q.shape[1] * 2
    if group_size < 8 or group_size % 8 or k % group_size:
        raise ValueError(f"group_size must be a multiple of 8 dividing {k}, got {group_size}")
    if scales.shape != (n, k // group_size):
        raise ValueError(f"scales must be [{n}, {k // group_size}], got {list(scales.shape)}")
    return n, k


def pack_int4(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> PackedInt4 | None:
    """Canonical ``q [N, K / 2]`` uint8 and ``scales [N, K / group_size]`` -> the kernel's
    layout (module docstring), or ``None`` without the native library.

    Raises:
        ValueError: naming ``q``, ``scales`` or ``group_size`` when they do not fit.
    """
    n, k = _check(q, scales, group_size)
    if _lib() is None:
        return None
    nb, kp, groups = -(-n // 16), k // 8, k // group_size
    lo, hi = q & 0xF, q >> 4
    v = torch.stack((lo, hi), dim=-1).reshape(n, k)  # value k at column k
    v = torch.nn.functional.pad(v, (0, 0, 0, nb * 16 - n)).view(nb, 16, kp, 2, 4)
    packed = v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)  # [nb, 16, kp, 4]
    wp = packed.permute(0, 2, 1, 3).contiguous().view(-1)
    s = torch.nn.functional.pad(scales.float(), (0, 0, 0, nb * 16 - n))
    ws = s.view(nb, 16, groups).permute(0, 2, 1).contiguous().view(-1)
    return PackedInt4(wp, ws, n, k, group_size)


def unpack_int4(p: PackedInt4) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical ``q [N, K / 2]`` uint8 and ``scales [N, groups]`` float32 back from
    the packed layout (torch ops only)."""
    nb, kp, groups = -(-p.n // 16), p.k // 8, p.k // p.group_size
    u = p.wp.view(nb, kp, 16, 4).permute(0, 2, 1, 3)  # [nb, 16, kp, 4]
    v = torch.stack((u & 0xF, u >> 4), dim=3).reshape(nb * 16, p.k)[: p.n]
    q = (v[:, 0::2] | (v[:, 1::2] << 4)).contiguous()
    s = p.ws.view(nb, groups, 16).permute(0, 2, 1).reshape(nb * 16, groups)[: p.n]
    return q, s.contiguous()


def int4_linear(x: torch.Tensor, p: PackedInt4, bias: torch.Tensor | None,
                path: int | None = None) -> torch.Tensor:
    """``w4a8_group_linear`` for the packed weight, on the native kernel where it serves
    (bf16 / float32 CPU ``x``), else the torch reference.

    Args:
        x: ``[..., K]`` float.
        p: the packed weight and scales.
        bias: ``[N]`` or ``None`` (added in float32).
        path: a kernel path (``int8_native.PATHS``) to force, e.g. in tests; ``None``:
            the best this library runs here.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: naming ``x`` when its last dimension is not ``K``, or ``path``
            when the library does not run it here.
        RuntimeError: when the kernel fails (out of memory).
    """
    if x.shape[-1] != p.k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {p.k}")
    lib = _lib()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        q, s = unpack_int4(p)
        return w4a8_group_linear(x, q, s, p.group_size, bias)
    path, x2, y = prepare_rows(lib, x, p.k, p.n, path)
    m = x2.shape[0]
    if m == 0:
        return y.view(*x.shape[:-1], p.n)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.int4_linear(path, int(x.dtype == torch.bfloat16), x2.data_ptr(), x2.stride(0),
                         p.wp.data_ptr(), p.ws.data_ptr(), p.group_size,
                         None if b is None else b.data_ptr(), y.data_ptr(), p.n, m, p.n, p.k,
                         torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"int4_linear failed with code {rc}")
    return y.view(*x.shape[:-1], p.n)
