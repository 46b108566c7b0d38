"""W8A8 linear on the native kernel (``kernels/csrc/int8_linear_cpu.c``): int8 weights
per output channel, activations quantized per token inside the kernel, int32 dot
products (VPDPBUSD on CPUs with VNNI), equal to ``grouped.int8_rowwise_linear``.

The weight is repacked once (``pack_int8``) into the kernel's layout: 16 output
channels x 4 inputs per 64 bytes, zero-padded to whole groups, with each channel's
weight sum (VPDPBUSD takes unsigned activations: the kernel adds 128 to them and
subtracts ``128 * wsum``). ``unpack_int8`` recovers ``q`` from it, so a layer keeps
one copy of its weight and can still run the torch reference when the native library
is absent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import backend
from tandem.kernels.native_abi import ABI, NativeLibrary
from tandem.kernels.quant.grouped import int8_rowwise_linear

PATH_SCALAR = ABI.constants["TANDEM_INT8_SCALAR"]
PATH_AVX2 = ABI.constants["TANDEM_INT8_AVX2"]
PATH_AVX_VNNI = ABI.constants["TANDEM_INT8_AVX_VNNI"]
PATH_AVX512_VNNI = ABI.constants["TANDEM_INT8_AVX512_VNNI"]
#: Worst to best: the layers run the last one the library offers.
PATHS = (PATH_SCALAR, PATH_AVX2, PATH_AVX_VNNI, PATH_AVX512_VNNI)


def _lib() -> NativeLibrary | None:
    return backend.current().native()


def available_paths(lib: NativeLibrary) -> list[int]:
    """The kernel paths ``lib`` runs on this CPU, worst to best."""
    mask = int(lib.int8_linear_paths())
    return [p for p in PATHS if mask >> p & 1]


def prepare_rows(lib: NativeLibrary, x: torch.Tensor, k: int, n: int, path: int | None
                 ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """What every integer-dot linear wrapper (int8, int4, GGUF) hands its kernel.

    Args:
        lib: the loaded native library; x: ``[..., k]`` float32 / bf16 activations;
        n: output features; path: an ISA path to force (tests), ``None``: the best.

    Returns:
        ``(path, x2, y)``: the path to run, ``x`` as ``[m, k]`` rows with a unit last
        stride, and the uninitialised ``[m, n]`` output in ``x``'s dtype.

    Raises:
        ValueError: ``path`` is not one ``lib`` runs on this CPU.
    """
    paths = available_paths(lib)
    if path is None:
        path = paths[-1]
    elif path not in paths:
        raise ValueError(f"path {path} is not run by the {lib.variant} library here ({paths})")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return path, x2, torch.empty((x2.shape[0], n), dtype=x.dtype)


@dataclass
class PackedInt8:
    """A ``[N, K]`` int8 weight in the kernel's layout.

    Attributes:
        wp: ``[ceil(N / 16) * ceil(K / 4) * 64]`` int8, the packed values.
        wsum: ``[ceil(N / 16) * 16]`` int32 row sums of ``q`` (0 on padding rows).
        n / k: the weight's shape.
    """

    wp: torch.Tensor
    wsum: torch.Tensor
    n: int
    k: int


def pack_int8(q: torch.Tensor) -> PackedInt8 | None:
    """``q [N, K]`` int8 -> its packed layout, or ``None`` without the native library.

    Raises:
        ValueError: naming ``q`` when it is not a 2-D int8 CPU tensor.
    """
    if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu":
        raise ValueError(f"q must be a 2-D int8 CPU tensor, got {q.dtype} "
                         f"{list(q.shape)} on {q.device}")
    lib = _lib()
    if lib is None:
        return None
    n, k = q.shape
    nb, kq = -(-n // 16), -(-k // 4)
    q = q.contiguous()
    wp = torch.empty(nb * kq * 64, dtype=torch.int8)
    wsum = torch.empty(nb * 16, dtype=torch.int32)
    lib.int8_pack_weight(q.data_ptr(), n, k, wp.data_ptr(), wsum.data_ptr())
    return PackedInt8(wp, wsum, n, k)


def unpack_int8(p: PackedInt8) -> torch.Tensor:
    """The ``[N, K]`` int8 weight back from its packed layout (torch ops only)."""
    nb, kq = -(-p.n // 16), -(-p.k // 4)
    w = p.wp.view(nb, kq, 16, 4).permute(0, 2, 1, 3).reshape(nb * 16, kq * 4)
    return w[: p.n, : p.k].contiguous()


def int8_linear(x: torch.Tensor, p: PackedInt8, scale: torch.Tensor,
                bias: torch.Tensor | None, path: int | None = None) -> torch.Tensor:
    """``int8_rowwise_linear(x, q, scale, bias)`` for the packed ``q``, on the native
    kernel where it serves (bf16 / float32 ``x``), else the torch reference.

    Args:
        x: ``[..., K]`` float.
        p: the packed weight; scale: ``[N]`` float32 per-channel weight scales.
        bias: ``[N]`` or ``None`` (added in float32).
        path: a kernel path (``PATHS``) to force, e.g. in tests; ``None``: the best.

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
        return int8_rowwise_linear(x, unpack_int8(p), scale, bias)
    path, x2, y = prepare_rows(lib, x, p.k, p.n, path)
    m = x2.shape[0]
    if m == 0:
        return y.view(*x.shape[:-1], p.n)
    b = None if bias is None else bias.float().contiguous()
    s = scale.float().contiguous()
    rc = lib.int8_linear(path, int(x.dtype == torch.bfloat16), x2.data_ptr(), x2.stride(0),
                         p.wp.data_ptr(), p.wsum.data_ptr(), s.data_ptr(),
                         None if b is None else b.data_ptr(), y.data_ptr(), p.n, m, p.n, p.k,
                         torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"int8_linear failed with code {rc}")
    return y.view(*x.shape[:-1], p.n)
