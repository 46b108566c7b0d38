"""Native CPU linear wrappers: bf16 weights packed once into VNNI tiles
(``bf16_pack_weight``), then ``x @ W.T + bias`` (``bf16_linear``), a fused gate/up
projection with SwiGLU (``bf16_linear_swiglu``) and an LM head with greedy argmax
(``bf16_linear_argmax``), on AMX tiles, AVX512-BF16 or AVX2 + FMA
(``bf16_linear_path``; ``csrc/bf16_linear_cpu.c``).
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu_native import load, use_tiles
from tandem.kernels.host_memory import empty_huge_page_tensor
from tandem.kernels.native_abi import ABI

LINEAR_NONE = ABI.constants["TANDEM_LINEAR_NONE"]
LINEAR_FMA = ABI.constants["TANDEM_LINEAR_FMA"]  # AVX2 + FMA, weights widened in registers
LINEAR_BF16 = ABI.constants["TANDEM_LINEAR_BF16"]  # AVX512-BF16 (and AMX tiles)


def bf16_linear_path() -> int:
    """Which path runs the packed linear kernels here (``csrc/bf16_linear_cpu.c``):
    ``LINEAR_BF16`` (a build for a CPU with AVX512-BF16, on AMX tiles where
    ``amx_available()``), ``LINEAR_FMA`` (AVX2 + FMA: ``bf16_linear`` and
    ``bf16_linear_argmax`` only, no fused SwiGLU) or ``LINEAR_NONE``."""
    lib = load()
    return LINEAR_NONE if lib is None else int(lib.bf16_linear_path())


def bf16_linear_available() -> bool:
    """Whether the AVX512-BF16 linear kernels (fused SwiGLU included) run here."""
    return bf16_linear_path() == LINEAR_BF16


def bf16_linear_supports(out_features: int, in_features: int, path: int = LINEAR_BF16) -> bool:
    """Whether ``bf16_linear`` takes a ``[out_features, in_features]`` weight on this
    machine with kernel path ``path`` (``bf16_linear_path()``'s values)."""
    return in_features % 32 == 0 and out_features % 16 == 0 and bf16_linear_path() == path


def bf16_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a bf16 ``[N, K]`` weight into the VNNI tiles the bf16 linear kernels
    read (see ``csrc/bf16_linear_cpu.c``): a flat ``[N * K]`` bf16 tensor. Needs
    ``N % 16 == 0``, ``K % 32 == 0`` and a ``bf16_linear_path()`` other than
    ``LINEAR_NONE``.

    Raises:
        ValueError: on a shape or dtype the kernel does not take, or a build with
            neither AVX512-BF16 nor AVX2 + FMA.
    """
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 16 or k % 32 or bf16_linear_path() == LINEAR_NONE:
        raise ValueError(
            f"bf16 packing needs a bf16 [N % 16, K % 32] weight and a CPU with "
            f"AVX512-BF16 or AVX2 + FMA, got {weight.dtype} {tuple(weight.shape)}"
        )
    lib = load()
    assert lib is not None
    w = weight.detach().contiguous()
    # streamed from memory at every decode step: huge pages save the page walks
    packed = empty_huge_page_tensor((n * k,), torch.bfloat16)
    lib.bf16_pack_weight(w.data_ptr(), n, k, packed.data_ptr())
    return packed



def bf16_linear_swiglu(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    tiles: bool | None = None,
) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection in one pass:
    ``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` where ``W = [Wg; Wu]`` is
    ``[out_features, K]`` packed by ``bf16_pack_weight``.

    Args:
        x: ``[M, K]`` bf16, unit stride in the last dim; bias: ``[out_features]``
            bf16 or ``None``; ``out_features % 32 == 0``.
        tiles: on AMX tiles (``None``: where ``amx_available()``), else VDPBF16PS.

    Returns:
        ``[M, out_features // 2]`` bf16, bit-identical to ``bf16_linear`` (same
        ``tiles``) followed by ``silu_and_mul_cpu``.

    Raises:
        ValueError: on an argument of the wrong dtype, shape or stride.
        RuntimeError: when the kernel rejects the shapes, ``tiles=True`` without AMX,
            or a path other than ``LINEAR_BF16`` (``bf16_linear_available()``).
    """
    y = torch.empty((x.shape[0], out_features // 2), dtype=torch.bfloat16)
    return _linear_call("bf16_linear_swiglu", tiles, x, packed, bias, out_features, y, y.shape[1])


def _check_linear_args(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> None:
    """The shapes, dtypes and strides the linear kernels read, checked before any
    pointer reaches C.

    Raises:
        ValueError: naming the argument that does not fit.
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(
            f"x must be a [M, K] bf16 CPU tensor with unit stride in K, got {x.dtype} "
            f"{tuple(x.shape)} strides {x.stride()} on {x.device}"
        )
    if x.shape[0] < 1:
        raise ValueError("x must have at least one row")
    if packed.dtype != torch.bfloat16 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous bf16 tensor, got {packed.dtype}")
    if packed.numel() != out_features * x.shape[1]:
        raise ValueError(
            f"packed holds {packed.numel()} elements, not out_features x K = "
            f"{out_features} x {x.shape[1]}"
        )
    if bias is not None and (
        bias.dtype != torch.bfloat16 or bias.numel() != out_features or not bias.is_contiguous()
    ):
        raise ValueError(
            f"bias must be a contiguous bf16 [{out_features}] tensor, got {bias.dtype} "
            f"{tuple(bias.shape)}"
        )


def _linear_call(
    name: str,
    tiles: bool | None,
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    out: torch.Tensor,
    *out_args: int,
) -> torch.Tensor:
    """Call linear kernel ``name`` (tiles, x, its row stride, weight, bias, out,
    *out_args, M, N, K, threads) and return ``out``; raises RuntimeError on a
    non-zero code."""
    _check_linear_args(x, packed, bias, out_features)
    on_tiles = use_tiles(tiles)
    lib = load()
    assert lib is not None
    m, k = x.shape
    rc = getattr(lib, name)(
        int(on_tiles), x.data_ptr(), x.stride(0), packed.data_ptr(),
        bias.data_ptr() if bias is not None else None, out.data_ptr(), *out_args,
        m, out_features, k, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc} for x {tuple(x.shape)}")
    return out


def bf16_linear_argmax(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Row-wise argmax of ``x @ W.T + bias`` without materialising it: an LM head
    and greedy sampling in one pass (``W`` packed by ``bf16_pack_weight``).

    Why: with a large vocabulary the logits are a write and a re-read of
    megabytes per decode step (a large share of the LM head's time), only to be
    reduced to one token id per row when every request samples greedily.

    Args:
        x: ``[M, K]`` bf16, unit stride in the last dim; bias ``[N]`` bf16 or ``None``.
        tiles: on AMX tiles (``None``: where ``amx_available()``), else VDPBF16PS
            or, on the ``LINEAR_FMA`` path, float32 FMAs.

    Returns:
        ``[M]`` int64: per row the first index of the maximum of the bf16 outputs
        that ``bf16_linear`` (same ``tiles``) would return (of the first NaN where
        there is one), the same ids as ``bf16_linear(...).max(dim=-1).indices``.

    Raises:
        ValueError: on an argument of the wrong dtype, shape or stride.
        RuntimeError: when the kernel rejects the shapes or cannot allocate, or
            ``tiles=True`` without AMX.
    """
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    return _linear_call("bf16_linear_argmax", tiles, x, packed, bias, out_features, ids)


def bf16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    tiles: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` with ``W`` packed by ``bf16_pack_weight``.

    Args:
        x: ``[M, K]`` bf16, unit stride in the last dim; packed: from
            ``bf16_pack_weight``; bias: ``[N]`` bf16 or ``None``.
        tiles: on AMX tiles (``None``: where ``amx_available()``), else VDPBF16PS
            or, on the ``LINEAR_FMA`` path, float32 FMAs (other summation orders).

    Returns:
        ``[M, N]`` bf16 (float32 accumulation, one rounding).

    Raises:
        ValueError: on an argument of the wrong dtype, shape or stride.
        RuntimeError: when the kernel rejects the shapes, or ``tiles=True`` without AMX.
    """
    y = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    return _linear_call("bf16_linear", tiles, x, packed, bias, out_features, y, out_features)
