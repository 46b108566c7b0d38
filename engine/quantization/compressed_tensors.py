"""compressed-tensors checkpoints (``quant_method: compressed-tensors``; the formats of
the ``compressed-tensors`` library as llm-compressor writes them):

* ``pack-quantized`` (W4A16 / W8A16): ``weight_packed [out, in / pack]`` int32 packed
  along the input axis, each value stored unsigned (signed value + ``2**(bits-1)``),
  ``weight_scale [out, groups]`` (``groups = 1`` for the channel strategy),
  ``weight_shape [2]`` = ``[out, in]``, asymmetric: ``weight_zero_point [out / pack,
  groups]`` int32 packed along the output axis (same offset); actorder: ``weight_g_idx``.
* ``int-quantized`` / ``naive-quantized`` W8A8: ``weight [out, in]`` int8 and
  ``weight_scale [out, 1]``; activations quantized per token at run time.
* ``float-quantized`` FP8: ``weight [out, in]`` float8_e4m3fn and ``weight_scale``
  ``[1]`` (tensor) or ``[out, 1]`` (channel); computed weight-only (activations stay in
  the compute dtype, as vLLM's FP8 Marlin path on GPUs without FP8).

Every quantized layer must share one scheme (one ``config_groups`` entry targeting
``Linear``); ``ignore`` may name only layers outside the decoder's projections.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.engine.quantization.base import QuantizationMethod, QuantLinear
from tandem.engine.quantization.dense_linear import Fp8Linear, Int8Linear
from tandem.engine.quantization.gptq import checked_group_size
from tandem.engine.quantization.grouped_linear import GroupQuantLinear, act_order_perm
from tandem.kernels.quant.packing import unpack_int32

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PackedLinear4(GroupQuantLinear):
    """A ``pack-quantized`` layer (see the module docstring)."""

    def __init__(self, method: CompressedTensorsMethod, linear: nn.Linear,
                 part_sizes: list[int], prefix: str, dtype: torch.dtype) -> None:
        k, n = linear.in_features, linear.out_features
        super().__init__(k, n, part_sizes, linear.bias is not None, dtype)
        self.method = method
        bits = method.bits
        pack = 32 // bits
        gs = k if method.strategy == "channel" else checked_group_size(method.group_size, k,
                                                                         prefix)
        self.group_size = gs
        if k % pack:
            raise ValueError(f"{prefix}: {k} inputs do not pack {pack} values per int32")
        self.add_checkpoint_param("weight_packed", (n, k // pack), torch.int32, out_dim=0)
        self.add_checkpoint_param("weight_scale", (n, k // gs), torch.float32, out_dim=0)
        self.add_checkpoint_param("weight_shape", (len(part_sizes), 2), torch.int64,
                                  per_part=True)
        if not method.symmetric:
            self.add_checkpoint_param("weight_zero_point", (-(-n // pack), k // gs),
                                      torch.int32, out_dim=0, out_pack=pack)
        if method.actorder:
            self.add_checkpoint_param("weight_g_idx", (k,), torch.int32, shared=True)

    def finish_loading(self, prefix: str) -> None:
        bits = self.method.bits
        for i, rows in enumerate(self.part_sizes):
            shape = tuple(int(v) for v in self.ckpt("weight_shape")[i])
            if shape != (rows, self.in_features):
                raise ValueError(f"quantized tensor '{prefix}.weight_shape' (part {i}) says "
                                 f"{shape}, the layer is {(rows, self.in_features)}")
        values = unpack_int32(self.ckpt("weight_packed"), bits, 1)
        if self.method.symmetric:
            zeros = torch.full(self.ckpt("weight_scale").shape, float(1 << (bits - 1)))
        else:
            zp = unpack_int32(self.ckpt("weight_zero_point"), bits, 0)
            zeros = zp[: self.out_features].float()
            self.drop_checkpoint_params("weight_zero_point")
        perm = None
        if self.method.actorder:
            perm = act_order_perm(self.ckpt("weight_g_idx"), self.group_size, self.in_features,
                                  f"{prefix}.weight_g_idx")
            self.drop_checkpoint_params("weight_g_idx")
        scales = self.ckpt("weight_scale")
        self.drop_checkpoint_params("weight_packed", "weight_scale", "weight_shape")
        self.set_weights(values, scales, zeros, bits, self.group_size, perm)


class CompressedTensorsMethod(QuantizationMethod):
    """``quant_method: compressed-tensors`` (see the module docstring)."""

    name = "compressed-tensors"

    def __init__(self, fmt: str, weights: dict[str, Any]) -> None:
        self.format = fmt
        self.bits = int(weights.get("num_bits", 8))
        self.strategy = str(weights.get("strategy", "tensor"))
        self.group_size = weights.get("group_size")
        self.symmetric = bool(weights.get("symmetric", True))
        self.actorder = weights.get("actorder") not in (None, False)

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> CompressedTensorsMethod:
        def bad(what: str) -> ValueError:
            return ValueError(f"quantization compressed-tensors: {what} is not supported")

        groups = list((qcfg.get("config_groups") or {}).values())
        if not groups:
            raise bad("a quantization_config without config_groups")
        schemes = {repr((g.get("weights"), g.get("input_activations"))) for g in groups}
        if len(schemes) > 1:
            raise bad("more than one scheme (config_groups with different weights)")
        group = groups[0]
        if "Linear" not in (group.get("targets") or []):
            raise bad(f"targets {group.get('targets')!r} (only Linear)")
        for name in qcfg.get("ignore") or []:
            if any(p in str(name) for p in _PROJECTIONS):
                raise bad(f"ignore of a decoder projection ({name!r})")
        fmt = str(group.get("format") or qcfg.get("format"))
        w = group.get("weights") or {}
        acts = group.get("input_activations")
        bits, typ, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if fmt == "pack-quantized":
            if typ != "int" or bits not in (4, 8):
                raise bad(f"pack-quantized {typ} {bits}-bit weights (int 4 or 8)")
            if strategy not in ("group", "channel"):
                raise bad(f"weight strategy {strategy!r} for pack-quantized (group, channel)")
            if w.get("actorder") not in (None, False, "group", "weight"):
                raise bad(f"actorder {w.get('actorder')!r}")
            if acts is not None:
                raise bad("quantized input_activations with pack-quantized weights")
        elif fmt in ("int-quantized", "naive-quantized"):
            if typ != "int" or bits != 8 or strategy != "channel" or not w.get("symmetric", True):
                raise bad(f"{fmt} weights {typ} {bits}-bit {strategy} (symmetric int8 channel)")
            if not acts or not acts.get("dynamic") or acts.get("strategy") != "token" \
                    or acts.get("num_bits") != 8 or not acts.get("symmetric", True):
                raise bad(f"{fmt} input_activations {acts!r} (dynamic symmetric int8 per token)")
        elif fmt == "float-quantized":
            if typ != "float" or bits != 8 or strategy not in ("tensor", "channel"):
                raise bad(f"float-quantized weights {typ} {bits}-bit {strategy} "
                          "(float 8 tensor or channel)")
        else:
            raise bad(f"format {fmt!r} (pack-quantized, int-quantized, float-quantized)")
        return cls(fmt, w)

    def create_linear(self, linear: nn.Linear, part_sizes: list[int], prefix: str,
                      dtype: torch.dtype) -> QuantLinear:
        k, n, bias = linear.in_features, linear.out_features, linear.bias is not None
        if self.format == "pack-quantized":
            return PackedLinear4(self, linear, part_sizes, prefix, dtype)
        if self.format == "float-quantized":
            return Fp8Linear(k, n, part_sizes, bias, dtype, self.strategy)
        layer = Int8Linear(k, n, part_sizes, bias, dtype)
        layer.add_checkpoint_tensors()
        return layer

    def skip_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Static activation scales (``input_scale``) of a weight-only run are unused."""
        return name.endswith(".input_scale") and self.format == "float-quantized"
