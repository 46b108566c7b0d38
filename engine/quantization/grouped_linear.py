"""``GroupQuantLinear``: the layer the checkpoint integer methods (GPTQ, AWQ,
compressed-tensors ``pack-quantized``) end as, in the canonical layout of
``kernels/quant/packing.py``; ``Int4Linear``, on-load int4's (W4A8 on the CPU); and the
act-order permutation from a ``g_idx``."""

from __future__ import annotations

import torch

from tandem.engine.quantization.base import QuantLinear
from tandem.kernels.quant.grouped import grouped_linear_reference, w4a8_group_linear
from tandem.kernels.quant.int4_native import PackedInt4, int4_linear, pack_int4
from tandem.kernels.quant.packing import to_canonical
from tandem.kernels.quant.triton_grouped import grouped_linear_triton


def act_order_perm(g_idx: torch.Tensor, group_size: int, in_features: int,
                   name: str) -> torch.Tensor | None:
    """The input permutation that makes a ``g_idx``'s groups contiguous, or ``None``
    when it is already the trivial ``arange(in) // group_size``.

    Args:
        g_idx: ``[in]`` integer group of each input column (GPTQ ``desc_act``).
        group_size / in_features: of the layer.
        name: the tensor's name, for errors.

    Raises:
        ValueError: naming ``name``: a wrong length, a group index out of range, or a
            group that does not hold exactly ``group_size`` columns.
    """
    if g_idx.shape != (in_features,):
        raise ValueError(f"quantized tensor {name!r} has shape {tuple(g_idx.shape)}, "
                         f"expected ({in_features},)")
    groups = in_features // group_size
    g = g_idx.to(torch.int64)
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise ValueError(f"quantized tensor {name!r}: group indices must lie in "
                         f"[0, {groups}), got {int(g.min())}..{int(g.max())}")
    counts = torch.bincount(g, minlength=groups)
    if not bool((counts == group_size).all()):
        raise ValueError(f"quantized tensor {name!r} does not match the group size "
                         f"{group_size}: each group must hold {group_size} columns")
    trivial = torch.arange(in_features, device=g.device) // group_size
    if torch.equal(g, trivial):
        return None
    return torch.sort(g, stable=True).indices


class GroupQuantLinear(QuantLinear):
    """A linear over canonical group-quantized weights (``kernels/quant/grouped.py``).

    Built from unpacked values by ``set_weights``; holds buffers ``q`` (uint8, see
    ``packing.to_canonical``), ``scales [out, groups]`` (compute dtype), ``zeros
    [out, groups]`` float32 or ``None``, ``perm [in]`` int64 or ``None``.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None

    bits: int = 4
    group_size: int = 128

    def set_weights(self, values: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor | None, bits: int, group_size: int,
                    perm: torch.Tensor | None) -> None:
        """Store the weight in the canonical layout.

        Args:
            values: ``[out, in]`` unsigned integer values in input order.
            scales / zeros: ``[out, in / group_size]`` (zeros in units of ``values``).
            bits / group_size: of the values.
            perm: act-order permutation (``act_order_perm``) or ``None``.
        """
        if perm is not None:
            values = values.index_select(1, perm)
        self.bits, self.group_size = bits, group_size
        self.register_buffer("q", to_canonical(values, bits), persistent=False)
        self.register_buffer("scales", scales.to(self.compute_dtype).contiguous(),
                             persistent=False)
        self.register_buffer("zeros", None if zeros is None else zeros.float().contiguous(),
                             persistent=False)
        self.register_buffer("perm", perm, persistent=False)

    def finish_loading(self, prefix: str) -> None:
        """Nothing to repack (built by ``set_weights``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return grouped_linear_triton(x, self.q, self.scales, self.zeros, self.bits,
                                         self.group_size, self.perm, self.bias)
        return grouped_linear_reference(x, self.q, self.scales, self.zeros, self.bits,
                                        self.group_size, self.perm, self.bias)


class Int4Linear(QuantLinear):
    """On-load int4 (``methods.Int4OnLoad``): symmetric 4-bit groups, values ``0..15``
    around the zero point 8, float32 scales per channel and group.

    On the CPU it runs W4A8 (``grouped.w4a8_group_linear``: activations quantized per
    token, as on-load int8 is W8A8): on the native kernel's packing of the weight
    (buffers ``wp``, ``ws``: ``kernels/quant/int4_native.py``) where the native library
    loads, else the torch reference on ``q`` (canonical ``[out, in / 2]`` uint8) and
    ``scales [out, groups]`` float32; one copy of the weight either way. On CUDA it is
    weight-only on the grouped Triton kernel (``q``, ``scales`` in the compute dtype,
    ``zeros``), as ``Int8Linear`` is there.
    """

    q: torch.Tensor | None
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    wp: torch.Tensor | None
    ws: torch.Tensor | None

    group_size: int = 128

    def set_int4(self, values: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
        """Take ``values [out, in]`` integers in ``0..15`` (zero point 8) and ``scales
        [out, in / group_size]``.

        Raises:
            ValueError: naming ``group_size`` when it is not a multiple of 8 dividing
                ``in`` (the kernel's unit).
        """
        self.group_size = group_size
        q = to_canonical(values, 4)
        cuda = values.device.type != "cpu"
        packed = None if cuda else pack_int4(q, scales.float().contiguous(), group_size)
        if cuda:
            s = scales.to(self.compute_dtype).contiguous()
            zeros = torch.full(s.shape, 8.0, device=s.device)
        else:
            s, zeros = scales.float().contiguous(), None
        self.register_buffer("q", None if packed else q, persistent=False)
        self.register_buffer("scales", None if packed else s, persistent=False)
        self.register_buffer("zeros", zeros, persistent=False)
        self.register_buffer("wp", packed.wp if packed else None, persistent=False)
        self.register_buffer("ws", packed.ws if packed else None, persistent=False)

    def finish_loading(self, prefix: str) -> None:
        """Nothing to repack (built by ``set_int4``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            assert self.q is not None and self.scales is not None, "set_int4 on CUDA tensors"
            return grouped_linear_triton(x, self.q, self.scales, self.zeros, 4,
                                         self.group_size, None, self.bias)
        if self.q is not None:
            assert self.scales is not None, "set_int4 was not called"
            return w4a8_group_linear(x, self.q, self.scales, self.group_size, self.bias)
        assert self.wp is not None and self.ws is not None, "set_int4 was not called"
        packed = PackedInt4(self.wp, self.ws, self.out_features, self.in_features,
                            self.group_size)
        return int4_linear(x, packed, self.bias)
