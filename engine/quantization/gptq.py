"""GPTQ checkpoints (Frantar et al. 2022, arXiv:2210.17323) as AutoGPTQ / GPTQModel
write them: per linear ``qweight [in / pack, out]`` int32 (packed along the input axis),
``qzeros [groups, out / pack]`` int32 (along the output axis), ``scales [groups, out]``
fp16 and ``g_idx [in]`` int32, ``pack = 32 // bits``; ``W = (q - z) * s`` per group.

``quantization_config``: ``bits`` (4 or 8), ``group_size`` (-1: one group per row),
``desc_act`` (act-order: ``g_idx`` is a permutation of the groups), ``sym``, and
GPTQModel's ``checkpoint_format``: "gptq" (v1, the default) stores each zero point minus
1, the historical AutoGPTQ offset; "gptq_v2" stores it as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.engine.quantization.base import QuantizationMethod
from tandem.engine.quantization.grouped_linear import GroupQuantLinear, act_order_perm
from tandem.kernels.quant.packing import unpack_int32


def checked_group_size(group_size: Any, in_features: int, prefix: str) -> int:
    """``group_size`` (-1: the whole row) resolved for a layer of ``in_features`` inputs.

    Raises:
        ValueError: naming the layer and group size when it does not divide the input.
    """
    gs = in_features if group_size == -1 else int(group_size)
    if gs <= 0 or in_features % gs:
        raise ValueError(f"{prefix}: group_size {group_size} does not divide the layer's "
                         f"{in_features} inputs")
    return gs


class GPTQLinear(GroupQuantLinear):
    """A GPTQ layer: loads the four checkpoint tensors, repacks to canonical."""

    def __init__(self, method: GPTQMethod, linear: nn.Linear, part_sizes: list[int],
                 prefix: str, dtype: torch.dtype) -> None:
        k, n = linear.in_features, linear.out_features
        super().__init__(k, n, part_sizes, linear.bias is not None, dtype)
        self.method = method
        pack = 32 // method.bits
        gs = checked_group_size(method.group_size, k, prefix)
        if k % pack or n % pack:
            raise ValueError(f"{prefix}: shape [{n}, {k}] does not pack {pack} values per int32")
        groups = k // gs
        self.add_checkpoint_param("qweight", (k // pack, n), torch.int32, out_dim=1)
        self.add_checkpoint_param("qzeros", (groups, n // pack), torch.int32, out_dim=1,
                                  out_pack=pack)
        self.add_checkpoint_param("scales", (groups, n), torch.float32, out_dim=1)
        self.add_checkpoint_param("g_idx", (k,), torch.int32, shared=True)
        self.group_size = gs

    def finish_loading(self, prefix: str) -> None:
        m = self.method
        values = unpack_int32(self.ckpt("qweight"), m.bits, 0).t()  # [out, in]
        zeros = unpack_int32(self.ckpt("qzeros"), m.bits, 1).t().float()  # [out, groups]
        if m.checkpoint_format == "gptq":
            zeros += 1  # v1 stores z - 1 (AutoGPTQ's historical offset)
        perm = act_order_perm(self.ckpt("g_idx"), self.group_size, self.in_features,
                              f"{prefix}.g_idx")
        scales = self.ckpt("scales").t()
        self.drop_checkpoint_params("qweight", "qzeros", "g_idx", "scales")
        self.set_weights(values, scales, zeros, m.bits, self.group_size, perm)


class GPTQMethod(QuantizationMethod):
    """``quant_method: gptq`` (see the module docstring)."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool,
                 checkpoint_format: str) -> None:
        self.bits, self.group_size = bits, group_size
        self.desc_act, self.sym, self.checkpoint_format = desc_act, sym, checkpoint_format

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> GPTQMethod:
        bits = qcfg.get("bits", 4)
        if bits not in (4, 8):
            raise ValueError(f"quantization gptq: bits {bits} is not supported (4 or 8)")
        fmt = qcfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization gptq: checkpoint_format {fmt!r} is not supported "
                             "(gptq, gptq_v2)")
        gs = qcfg.get("group_size", 128)
        if not isinstance(gs, int) or (gs != -1 and gs < 1):
            raise ValueError(f"quantization gptq: group_size {gs!r} is not supported")
        return cls(bits, gs, bool(qcfg.get("desc_act", False)), bool(qcfg.get("sym", True)),
                   fmt)

    def create_linear(self, linear: nn.Linear, part_sizes: list[int], prefix: str,
                      dtype: torch.dtype) -> GPTQLinear:
        return GPTQLinear(self, linear, part_sizes, prefix, dtype)

    def skip_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """AutoGPTQ saves a bias for every quantized layer, zeros where it had none: the
        zeros are dropped (a layer with a real bias keeps it: not all zeros)."""
        return name.endswith(".bias") and not bool(tensor.any())
