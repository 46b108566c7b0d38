"""AWQ checkpoints (Lin et al. 2023, arXiv:2306.00978) in AutoAWQ's GEMM packing:
per linear ``qweight [in, out / 8]`` int32 and ``qzeros [groups, out / 8]`` int32, both
packed along the output axis with the columns of each word in the interleaved order
``[0, 2, 4, 6, 1, 3, 5, 7]`` (``kernels/quant/packing.AWQ_ORDER``), and ``scales
[groups, out]`` fp16; ``W = (q - z) * s`` per group. ``quantization_config``: ``bits``
(``w_bit``) 4, ``group_size`` (``q_group_size``), ``zero_point`` true, ``version`` "gemm".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.engine.quantization.base import QuantizationMethod
from tandem.engine.quantization.gptq import checked_group_size
from tandem.engine.quantization.grouped_linear import GroupQuantLinear
from tandem.kernels.quant.packing import awq_unpack


class AWQLinear(GroupQuantLinear):
    """An AWQ GEMM layer: loads the three checkpoint tensors, repacks to canonical."""

    def __init__(self, method: AWQMethod, linear: nn.Linear, part_sizes: list[int],
                 prefix: str, dtype: torch.dtype) -> None:
        k, n = linear.in_features, linear.out_features
        super().__init__(k, n, part_sizes, linear.bias is not None, dtype)
        gs = checked_group_size(method.group_size, k, prefix)
        if n % 8:
            raise ValueError(f"{prefix}: {n} outputs do not pack 8 values per int32")
        self.add_checkpoint_param("qweight", (k, n // 8), torch.int32, out_dim=1, out_pack=8)
        self.add_checkpoint_param("qzeros", (k // gs, n // 8), torch.int32, out_dim=1,
                                  out_pack=8)
        self.add_checkpoint_param("scales", (k // gs, n), torch.float32, out_dim=1)
        self.group_size = gs

    def finish_loading(self, prefix: str) -> None:
        values = awq_unpack(self.ckpt("qweight")).t()
        zeros = awq_unpack(self.ckpt("qzeros")).t().float()
        scales = self.ckpt("scales").t()
        self.drop_checkpoint_params("qweight", "qzeros", "scales")
        self.set_weights(values, scales, zeros, 4, self.group_size, None)


class AWQMethod(QuantizationMethod):
    """``quant_method: awq`` (see the module docstring)."""

    name = "awq"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> AWQMethod:
        bits = qcfg.get("bits", qcfg.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"quantization awq: bits {bits} is not supported (4)")
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization awq: version {version!r} is not supported (gemm)")
        if not qcfg.get("zero_point", True):
            raise ValueError("quantization awq: zero_point false is not supported")
        gs = qcfg.get("group_size", qcfg.get("q_group_size", 128))
        if not isinstance(gs, int) or (gs != -1 and gs < 1):
            raise ValueError(f"quantization awq: group_size {gs!r} is not supported")
        return cls(gs)

    def create_linear(self, linear: nn.Linear, part_sizes: list[int], prefix: str,
                      dtype: torch.dtype) -> AWQLinear:
        return AWQLinear(self, linear, part_sizes, prefix, dtype)
