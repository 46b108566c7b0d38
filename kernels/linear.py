"""Linear layers with oneDNN-prepacked bfloat16 weights for the CPU.

Why: ``F.linear`` hands oneDNN a plain ``[out, in]`` weight on every call; a
weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op PyTorch's Inductor uses
when it freezes CPU models) skips that work. On the 2-core AVX-512 dev box the
decode-sized GEMMs (64 x 576 x 3072, bf16) ran 15-35% faster, with bit-identical
results. float32 weights are left alone: there the packed kernel sums in another
order, and the float32 path is the one checked token for token against
transformers.

On CPUs with AVX512-BF16, small batches (fewer than ``PACKED_MAX_ROWS`` tokens:
the decode steps) run our own kernel instead (``kernels/csrc/bf16_linear_cpu.c``)
on a second, VNNI-tiled packing of the weight: on AMX tiles where the CPU has
them, else with VDPBF16PS. On the 2-core Sapphire-Rapids-class box the tiles took
a SmolLM2 layer's four decode GEMMs (64 tokens) from ~0.86 to ~0.6 ms, and the
49152-row LM head from ~4.6 to ~2.8 ms, while oneDNN stayed ahead from ~128 rows
up (prefill). On a 2-core Zen 5 VM (no AMX) VDPBF16PS ran the layer shapes at
64 rows at 900-926 GFLOP/s against oneDNN's 694-904 (0.49 vs 0.55 ms a layer),
the LM head alone at 735 vs 782. The kernel also fuses SwiGLU, the head's
greedy argmax and (``kernels/fused_decode.py``) whole decode steps. Such layers
keep both packings, so their bf16 weights take twice the memory.

On CPUs where oneDNN has no bf16 GEMM (no AVX-512: e.g. an AVX2-only EPYC VM),
PyTorch's own bf16 GEMM ran ~21 GFLOP/s against ~100-126 for float32 on the same
shapes (64 and 2048 x 576 x 1536, 2 cores). There ``Float32ComputeLinear`` keeps
the bf16 layer's weight widened to float32 (exactly: every bf16 is a float32) and
runs the float32 GEMM, rounding the output to bf16 once, as a bf16 GEMM with
float32 accumulation does; the weight then takes twice the memory of bf16.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_ext

logger = logging.getLogger(__name__)

# Batch-size hint for the reorder (tokens); any batch size works at run time.
_PACK_BATCH_HINT = 64
# Below this many rows (tokens) the packed kernel serves; measured crossover
# ~128 on AMX; on Zen 5 VDPBF16PS was still ahead at 111.
PACKED_MAX_ROWS = 112


@functools.cache
def mkldnn_packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this PyTorch build *and this CPU* can prepack ``dtype`` linear weights
    for oneDNN.

    The ops exist in every x86 build, but oneDNN's bf16 reorder refuses CPUs
    without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, so a small weight is packed
    once to find out (cached per dtype for the process).
    """
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(
            torch.zeros(16, 16, dtype=dtype), _PACK_BATCH_HINT
        )
        torch.ops.mkldnn._linear_pointwise(
            torch.zeros(1, 16, dtype=dtype), probe, None, "none", [], ""
        )
    except RuntimeError as exc:
        logger.info("oneDNN %s weight packing unavailable on this CPU (%s)", dtype, exc)
        return False
    return True


def _adopt_bf16_cpu_linear(layer: nn.Module, linear: nn.Linear) -> torch.Tensor:
    """Give ``layer`` the ``in_features`` / ``out_features`` of ``linear`` and return
    ``linear.weight``, once checked to be bf16 on the CPU.

    Raises:
        ValueError: naming ``layer``'s class and the weight's dtype and device.
    """
    w = linear.weight
    if w.dtype != torch.bfloat16 or w.device.type != "cpu":
        raise ValueError(
            f"{type(layer).__name__} needs a bf16 CPU weight, got {w.dtype} on {w.device}"
        )
    layer.in_features = linear.in_features
    layer.out_features = linear.out_features
    return w


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` prepacked for oneDNN (CPU, bfloat16).

    Args:
        linear: the ``nn.Linear`` to replace; its weight ``[out, in]`` bf16 is
            reordered once, its bias (``[out]`` or ``None``) kept.

    Forward: ``x [..., in]`` bf16 -> ``[..., out]`` bf16. With fewer than
    ``PACKED_MAX_ROWS`` rows and a VNNI-packed copy of the weight
    (``vnni_weight``, kept where the CPU has AVX512-BF16 and the shape fits), our
    kernel runs (float32 accumulation, another summation order than oneDNN's).

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = _adopt_bf16_cpu_linear(self, linear)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        vnni = (
            cpu_ext.bf16_pack_weight(w)
            if cpu_ext.bf16_linear_supports(self.out_features, self.in_features)
            else None
        )
        self.register_buffer("vnni_weight", vnni, persistent=False)
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def _packed_serves(self, x2: torch.Tensor) -> bool:
        """Whether our packed kernel takes these ``[rows, in]`` inputs."""
        return (
            self.vnni_weight is not None
            and 0 < x2.shape[0] < PACKED_MAX_ROWS
            and x2.stride(1) == 1
            and x2.dtype == torch.bfloat16
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._packed_serves(x2):
            y = cpu_ext.bf16_linear(x2, self.vnni_weight, self.bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(
                x2, self.packed_weight, self.bias, "none", [], ""
            )
        return y.view(*lead, self.out_features)

    def forward_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Row-wise argmax of ``forward(x)`` (``[..., out]`` -> ``[...]`` int64, the
        first maximal index) in one pass of the packed kernel that never writes the
        outputs; ``None`` where that kernel does not serve this call."""
        x2 = x.reshape(-1, self.in_features)
        if not self._packed_serves(x2):
            return None
        ids = cpu_ext.bf16_linear_argmax(x2, self.vnni_weight, self.bias, self.out_features)
        return ids.view(x.shape[:-1])

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's output (``gate | up`` halves, as
        in a fused SwiGLU projection) in one pass of the packed kernel:
        ``[..., out // 2]`` bf16, bit-identical to ``forward`` then
        ``cpu_ext.silu_and_mul_cpu``. ``None`` when that kernel does not serve this
        call (no packed weight, too many rows, an odd number of column blocks): the
        caller runs the two steps."""
        x2 = x.reshape(-1, self.in_features)
        if not self._packed_serves(x2) or self.out_features % 32:
            return None
        y = cpu_ext.bf16_linear_swiglu(x2, self.vnni_weight, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features // 2)


class Float32ComputeLinear(nn.Module):
    """``y = x @ W.T + b`` for a bf16 layer, computed in float32 (CPUs without a
    fast bf16 GEMM; see the module docstring).

    Args:
        linear: the bf16 CPU ``nn.Linear`` to replace; its weight ``[out, in]`` and
            bias ``[out]`` are widened to float32 once (exact), the weight then
            prepacked for oneDNN where it can be (on the 2-core AVX2 box 5-25% faster
            than ``F.linear`` on layer shapes, 2x on the LM head at 16 rows).

    Forward: ``x [..., in]`` bf16 -> ``[..., out]`` bf16: the float32 product of the
    widened ``x`` and weight (float32 accumulation), rounded to bf16 once.

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = _adopt_bf16_cpu_linear(self, linear)
        w32 = w.detach().float().contiguous()
        self.packed = mkldnn_packing_available(torch.float32)
        if self.packed:
            w32 = torch.ops.mkldnn._reorder_linear_weight(w32, _PACK_BATCH_HINT)
        self.register_buffer("weight32", w32, persistent=False)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias32", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.weight32, self.bias32, "none", [], "")
        else:
            y = F.linear(x2, self.weight32, self.bias32)
        return y.to(x.dtype).view(*lead, self.out_features)


def replace_cpu_bf16_linear(module: nn.Linear) -> nn.Module:
    """A bf16 CPU ``nn.Linear`` made fast on this CPU: a ``PackedLinear`` where oneDNN
    has a bf16 GEMM, else a ``Float32ComputeLinear`` (see the module docstring).

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
        RuntimeError: from oneDNN, when an op is missing from this build.
    """
    cls = PackedLinear if mkldnn_packing_available() else Float32ComputeLinear
    return cls(module)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear`` (oneDNN
    has a bf16 GEMM on this CPU) or else a ``Float32ComputeLinear``.

    Idempotent (already replaced layers are skipped). Layers that fail to pack
    keep ``F.linear`` (logged once). Returns the number of layers replaced.
    """
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
            setattr(parent, name, replace_cpu_bf16_linear(child))
            packed += 1
        except RuntimeError as exc:  # an op missing from this oneDNN build
            logger.warning("oneDNN weight packing unavailable (%s): using F.linear", exc)
            break
    return packed
