"""Linear layers with oneDNN-prepacked bfloat16 weights for the CPU.

Why: ``F.linear`` hands oneDNN a plain ``[out, in]`` weight on every call; a
weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's Inductor uses
when it freezes CPU models) skips that work. On the 2-core AVX-512 dev box the
decode-sized GEMMs (64 x 576 x 3072, bf16) ran 15-35% faster, with bit-identical
results. float32 weights are left alone: there the packed kernel sums in another
order, and the float32 path is the one checked token for token against
transformers.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Batch-size hint for the reorder (tokens); any batch size works at run time.
_PACK_BATCH_HINT = 64


@functools.cache
def mkldnn_packing_available() -> bool:
    """Whether this PyTorch build *and this CPU* can prepack bf16 linear weights.

    The ops exist in every x86 build, but oneDNN's bf16 reorder refuses CPUs
    without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, so a small weight is packed
    once to find out (cached for the process).
    """
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros(16, 16, dtype=torch.bfloat16), _PACK_BATCH_HINT
        )
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, 16, dtype=torch.bfloat16), probe, None, "none", [], ""
        )
    except RuntimeError as exc:
        logger.info("oneDNN bf16 weight packing unavailable on this CPU (%s): using F.linear", exc)
        return False
    return True


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN (CPU, bfloat16).

    Args:
        linear: the ``nn.Linear`` to replace; its weight ``[out, in]`` bf16 is
            reordered once, its bias (``[out]`` or ``None``) kept.

    Forward: ``x [..., in]`` bf16 -> ``[..., out]`` bf16.

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            raise ValueError(f"PackedLinear needs a bf16 CPU weight, got {w.dtype} on {w.device}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features), self.packed_weight, self.bias, "none", [], ""
        )
        return y.view(*lead, self.out_features)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear``.

    Idempotent (already packed layers are skipped). Layers that fail to pack
    keep ``F.linear`` (logged once). Returns the number of layers packed.
    """
    if not mkldnn_packing_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
    ]
    packed = 0
    for parent, name, child in targets:
        try:
            setattr(parent, name, PackedLinear(child))
            packed += 1
        except RuntimeError as exc:  # an op missing from this oneDNN build
            logger.warning("oneDNN weight packing unavailable (%s): using F.linear", exc)
            break
    return packed
