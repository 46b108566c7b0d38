"""The methods without checkpoint tensors of their own: on-load ``int8`` / ``int4``, and
``quant_method: fp8`` checkpoints (transformers' FineGrainedFP8 / vLLM's serialized
FP8: ``weight`` float8_e4m3fn with ``weight_scale_inv`` per ``weight_block_size`` block,
or a per-tensor ``weight_scale``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tandem.engine.quantization.base import QuantizationMethod, QuantLinear
from tandem.engine.quantization.dense_linear import Fp8Linear, Int8Linear, quantize_int8_rows
from tandem.engine.quantization.grouped_linear import Int4Linear

logger = logging.getLogger(__name__)

#: on-load int4's group size, and the smaller ones taken where it does not divide the input
INT4_GROUP_SIZES = (128, 64, 32)


class Int8OnLoad(QuantizationMethod):
    """``--quantization int8``: each projection's weight quantized per output channel,
    symmetric (``quantize_int8_rows``), run as W8A8 with dynamic per-token scales."""

    name = "int8"
    on_load = True

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> Int8OnLoad:
        return cls()

    def quantize_linear(self, linear: nn.Linear, prefix: str) -> nn.Module:
        return int8_on_load(linear.weight, linear.bias)

    def quantize_head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """The LM head per row in int8 too, as the projections: at batch 1 the head is
        about a third of what a step reads once the layers are int8. Greedy rows take
        ``Int8Linear.forward_argmax``; logprobs and sampling read its full logits."""
        return int8_on_load(weight, bias)


def int8_on_load(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """An ``Int8Linear`` of ``weight [out, in]`` quantized per output row
    (``quantize_int8_rows``), ``bias [out]`` kept as it is (or ``None``)."""
    n, k = weight.shape
    q, s = quantize_int8_rows(weight)
    layer = Int8Linear(k, n, [n], False, weight.dtype)
    layer.bias = None if bias is None else nn.Parameter(bias.detach(), False)
    layer.set_int8(q, s)
    return layer


def quantize_int4_groups(w: torch.Tensor, group_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric group-wise int4: ``w [out, in]`` -> ``(values [out, in]`` in 0..15,
    ``scales [out, in / group_size]`` float32, ``zeros`` (8 everywhere)) with
    ``scales = max|w| / 7`` per group and ``values = clamp(round(w / s), -8, 7) + 8``."""
    n, k = w.shape
    g = w.detach().float().view(n, k // group_size, group_size)
    scales = g.abs().amax(dim=-1).clamp_min(1e-12) / 7.0
    q = torch.round(g / scales[..., None]).clamp_(-8, 7) + 8
    return q.view(n, k).to(torch.int32), scales, torch.full_like(scales, 8.0)


class Int4OnLoad(QuantizationMethod):
    """``--quantization int4``: group-wise symmetric int4 (``quantize_int4_groups``),
    group 128, or 64 / 32 for a layer whose input 128 does not divide (logged); run as
    W4A8 with dynamic per-token activation scales on the CPU (``Int4Linear``)."""

    name = "int4"
    on_load = True

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> Int4OnLoad:
        return cls()

    def quantize_linear(self, linear: nn.Linear, prefix: str) -> nn.Module:
        k = linear.in_features
        gs = next((g for g in INT4_GROUP_SIZES if k % g == 0), None)
        if gs is None:
            raise ValueError(f"quantization int4: {prefix} has {k} inputs, which no group "
                             f"size of {INT4_GROUP_SIZES} divides")
        if gs != INT4_GROUP_SIZES[0]:
            logger.info("int4: %s (%d inputs) uses group size %d", prefix, k, gs)
        values, scales, _ = quantize_int4_groups(linear.weight, gs)
        layer = Int4Linear(k, linear.out_features, [linear.out_features], False,
                           linear.weight.dtype)
        layer.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), False)
        layer.set_int4(values, scales, gs)
        return layer

    def quantize_head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
        """The LM head per row in int8 (``int8_on_load``), as a Q4 GGUF file keeps its
        output matrix at 8 bits: at batch 1 a bf16 head would be about half of what an
        int4 step reads, and 4-bit logits cost more accuracy than the layers'."""
        return int8_on_load(weight, bias)


class Fp8Method(QuantizationMethod):
    """``quant_method: fp8`` (see the module docstring); computed weight-only."""

    name = "fp8"

    def __init__(self, block: tuple[int, int] | None) -> None:
        self.block = block

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> Fp8Method:
        if not qcfg:
            raise ValueError("quantization fp8: on-load FP8 of an unquantized checkpoint is "
                             "not supported (int8 and int4 are)")
        fmt = qcfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization fp8: fmt {fmt!r} is not supported (e4m3)")
        block = qcfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"quantization fp8: weight_block_size {block!r} is not supported")
        return cls(None if block is None else (int(block[0]), int(block[1])))

    def create_linear(self, linear: nn.Linear, part_sizes: list[int], prefix: str,
                      dtype: torch.dtype) -> QuantLinear:
        k, n, bias = linear.in_features, linear.out_features, linear.bias is not None
        if self.block is None:
            return Fp8Linear(k, n, part_sizes, bias, dtype, "tensor")
        return Fp8Linear(k, n, part_sizes, bias, dtype, "block", self.block, "weight_scale_inv")

    def skip_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Static activation scales (``input_scale``) of a weight-only run are unused."""
        return name.endswith(".input_scale")
