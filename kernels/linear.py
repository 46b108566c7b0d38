"""Linear layers with oneDNN-prepacked bfloat16 weights for the CPU.

Why: ``F.linear`` hands oneDNN a plain ``[out, in]`` weight on every call; a
weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's Inductor uses
when it freezes CPU models) skips that work. On the 2-core AVX-512 dev box the
decode-sized GEMMs (64 x 576 x 3072, bf16) ran 15-35% faster, with bit-identical
results. float32 weights are left alone: there the packed kernel sums in another
order, and the float32 path is the one checked token for token against
transformers.

On CPUs with AMX-BF16, small batches (fewer than ``AMX_MAX_ROWS`` tokens: the
decode steps) run our AMX tile kernel instead (``kernels/csrc/amx_linear_cpu.c``):
on the 2-core Sapphire-Rapids-class box it took a SmolLM2 layer's four decode
GEMMs (64 tokens) from ~0.86 to ~0.6 ms, and the 49152-row LM head from ~4.6 to
~2.8 ms, while oneDNN stayed ahead from ~128 rows up (prefill). Such layers keep
both packings, so their bf16 weights take twice the memory.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from tandem.kernels import cpu_ext

logger = logging.getLogger(__name__)

# Batch-size hint for the reorder (tokens); any batch size works at run time.
_PACK_BATCH_HINT = 64
# Below this many rows (tokens) the AMX kernel serves; measured crossover ~128.
AMX_MAX_ROWS = 112


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

    Forward: ``x [..., in]`` bf16 -> ``[..., out]`` bf16. With fewer than
    ``AMX_MAX_ROWS`` rows and an AMX-packed copy of the weight (``amx_weight``,
    kept where the CPU has AMX-BF16 and the shape fits), the AMX kernel runs
    (float32 accumulation, another summation order than oneDNN's).

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
        amx = (
            cpu_ext.amx_pack_weight(w)
            if cpu_ext.amx_supports(self.out_features, self.in_features)
            else None
        )
        self.register_buffer("amx_weight", amx, persistent=False)
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def _amx_serves(self, x2: torch.Tensor) -> bool:
        """Whether the AMX kernel takes these ``[rows, in]`` inputs."""
        return self.amx_weight is not None and x2.shape[0] < AMX_MAX_ROWS and x2.stride(1) == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._amx_serves(x2):
            y = cpu_ext.amx_linear(x2, self.amx_weight, self.bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(
                x2, self.packed_weight, self.bias, "none", [], ""
            )
        return y.view(*lead, self.out_features)

    def forward_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Row-wise argmax of ``forward(x)`` (``[..., out]`` -> ``[...]`` int64, the
        first maximal index) in one AMX pass that never writes the outputs;
        ``None`` where the AMX kernel does not serve this call."""
        x2 = x.reshape(-1, self.in_features)
        if not self._amx_serves(x2) or x2.shape[0] == 0:
            return None
        ids = cpu_ext.amx_linear_argmax(x2, self.amx_weight, self.bias, self.out_features)
        return ids.view(x.shape[:-1])

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's output (``gate | up`` halves, as
        in a fused SwiGLU projection) in one AMX pass: ``[..., out // 2]`` bf16,
        bit-identical to ``forward`` then ``cpu_ext.silu_and_mul_cpu``. ``None``
        when the AMX kernel does not serve this call (no AMX weight, too many
        rows, an odd number of column blocks): the caller runs the two steps."""
        x2 = x.reshape(-1, self.in_features)
        if not self._amx_serves(x2) or self.out_features % 32:
            return None
        y = cpu_ext.amx_linear_swiglu(x2, self.amx_weight, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features // 2)


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
