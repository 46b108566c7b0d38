"""bfloat16 linear layers for the CPU: our packed kernel for decode-sized batches,
torch's public ``F.linear`` for the rest.

Why: ``F.linear`` is the fast path only where oneDNN has a native bf16 GEMM (CPUs
with AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX; ``Platform.fast_bf16_gemm``). There,
on CPUs with AVX512-BF16, batches of fewer than ``PACKED_MAX_ROWS`` tokens (the
decode steps) run our own kernel (``kernels/csrc/bf16_linear_cpu.c``) on a
VNNI-tiled packing of the weight, on AMX tiles where the CPU has them, else with
VDPBF16PS; it also fuses SwiGLU, the LM head's greedy argmax and
(``kernels/fused_decode.py``) whole decode steps. Such layers keep the plain and
the packed weight, so their bf16 weights take twice the memory.

On CPUs without a native bf16 GEMM (no AVX-512: e.g. an AVX2-only EPYC VM),
PyTorch's bf16 GEMM is several times slower than its float32 one on the same
shapes. There ``Float32ComputeLinear`` runs the FMA path of the same kernel file:
the VNNI-packed bf16 weight widened to float32 in registers (exactly: every bf16
is a float32), float32 FMAs, the output rounded to bf16 once, as a bf16 GEMM with
float32 accumulation does; at every batch size it was at least as fast as torch's
float32 GEMM on widened weights, with half the weight memory (docs/benchmarks.md).
Layers whose shape the kernel does not take keep a float32 copy for ``F.linear``.

Batch invariance (``ModelConfig.deterministic``): the packed kernels split a layer's
output columns over the threads and reduce each output element over K in one fixed
order (k blocks ascending, whatever M is; a partial 16-row chunk goes through a
zero-padded copy), so a row's output does not depend on the other rows. oneDNN
picks its blocking by M, so its output for the same row can change with the batch.
``batch_invariant=True`` therefore keeps every batch on the packed kernel (slower than
oneDNN on prefill-sized batches, docs/benchmarks.md, "Reproducible greedy"); a layer whose shape the kernel does not
take stays on torch's GEMM, and ``batch_variant_layers`` names it.

NOTE: PyTorch's oneDNN weight prepacking (``torch.ops.mkldnn._reorder_linear_weight``
/ ``_linear_pointwise``) is private API and is not used; docs/benchmarks.md has
what that cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import backend, cpu_ext

# Below this many rows (tokens) the AVX512-BF16 / AMX kernel serves: the crossover
# measured against oneDNN's bf16 GEMM, a little under it on the CPUs measured
# (docs/benchmarks.md). The FMA path serves every batch (no crossover measured).
PACKED_MAX_ROWS = 112


def fast_bf16_gemm() -> bool:
    """Whether torch has a native bf16 GEMM on this CPU (see the module docstring)."""
    return backend.current().platform.fast_bf16_gemm


class _AdoptsLinear(nn.Module):
    """A layer that stands in for an ``nn.Linear`` and keeps its feature counts."""

    in_features: int
    out_features: int


def _adopt_bf16_cpu_linear(layer: _AdoptsLinear, linear: nn.Linear) -> torch.Tensor:
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


class PackedLinear(_AdoptsLinear):
    """``y = x @ W.T + b`` for a bf16 CPU layer, small batches on our packed kernel.

    Args:
        linear: the ``nn.Linear`` to replace; its weight ``[out, in]`` bf16 is kept
            for the dense path (``F.linear``) and, where this machine's kernel path is
            ``KERNEL_PATH`` and the shape fits, packed once into ``vnni_weight``; its
            bias (``[out]`` or ``None``) kept.
        batch_invariant: run every batch size on the packed kernel (where there is a
            ``vnni_weight``), so a row's output never depends on the batch (see the
            module docstring); ``False``: oneDNN from ``MAX_PACKED_ROWS`` rows on.

    Forward: ``x [..., in]`` bf16 -> ``[..., out]`` bf16. With fewer than
    ``MAX_PACKED_ROWS`` rows (any number when ``batch_invariant``) and a
    ``vnni_weight``, our kernel runs (float32 accumulation, another summation order
    than oneDNN's); otherwise the dense path.

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
    """

    # The kernel path (cpu_ext.bf16_linear_path()) that packs this class's weights,
    # and the rows below which it serves (None: every batch).
    KERNEL_PATH = cpu_ext.LINEAR_BF16
    MAX_PACKED_ROWS: int | None = PACKED_MAX_ROWS

    # Buffers (registered below), declared for the type checker.
    weight: torch.Tensor
    vnni_weight: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, batch_invariant: bool = False) -> None:
        super().__init__()
        if batch_invariant:
            self.MAX_PACKED_ROWS = None  # this instance only: the class keeps the crossover
        w = _adopt_bf16_cpu_linear(self, linear)
        vnni = (
            cpu_ext.bf16_pack_weight(w)
            if cpu_ext.bf16_linear_supports(self.out_features, self.in_features, self.KERNEL_PATH)
            else None
        )
        self.register_buffer("vnni_weight", vnni, persistent=False)
        bias = linear.bias.detach().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self._keep_dense(linear, vnni is not None)

    def _keep_dense(self, linear: nn.Linear, packed: bool) -> None:
        """Register what the dense path reads (``packed``: whether a VNNI weight was
        kept): here always the bf16 weight itself, for batches of
        ``MAX_PACKED_ROWS`` rows or more."""
        self.register_buffer("weight", linear.weight.detach(), persistent=False)

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        """``[rows, in]`` -> ``[rows, out]`` bf16 through torch's GEMM."""
        return F.linear(x2, self.weight, self.bias)

    def _packed_for(self, x2: torch.Tensor) -> torch.Tensor | None:
        """The packed weight where our packed kernel takes these ``[rows, in]`` inputs,
        else ``None``."""
        rows = x2.shape[0]
        serves = (
            0 < rows
            and (self.MAX_PACKED_ROWS is None or rows < self.MAX_PACKED_ROWS)
            and x2.stride(1) == 1
            and x2.dtype == torch.bfloat16
        )
        return self.vnni_weight if serves else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        vnni = self._packed_for(x2)
        if vnni is not None:
            y = cpu_ext.bf16_linear(x2, vnni, self.bias, self.out_features)
        else:
            y = self._dense(x2)
        return y.view(*lead, self.out_features)

    def forward_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Row-wise argmax of ``forward(x)`` (``[..., out]`` -> ``[...]`` int64, the
        first maximal index) in one pass of the packed kernel that never writes the
        outputs; ``None`` where that kernel does not serve this call."""
        x2 = x.reshape(-1, self.in_features)
        vnni = self._packed_for(x2)
        if vnni is None:
            return None
        ids = cpu_ext.bf16_linear_argmax(x2, vnni, self.bias, self.out_features)
        return ids.view(x.shape[:-1])

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of this layer's output (``gate | up`` halves, as
        in a fused SwiGLU projection) in one pass of the packed kernel:
        ``[..., out // 2]`` bf16, bit-identical to ``forward`` then
        ``cpu_ext.silu_and_mul_cpu``. ``None`` when that kernel does not serve this
        call (no packed weight, too many rows, an odd number of column blocks): the
        caller runs the two steps."""
        x2 = x.reshape(-1, self.in_features)
        vnni = self._packed_for(x2)
        if vnni is None or self.out_features % 32:
            return None
        y = cpu_ext.bf16_linear_swiglu(x2, vnni, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features // 2)


class Float32ComputeLinear(PackedLinear):
    """``y = x @ W.T + b`` for a bf16 layer on CPUs without a fast bf16 GEMM (see the
    module docstring): every batch on our FMA kernel (``cpu_ext.LINEAR_FMA``: the
    packed bf16 weight widened to float32 in registers) where the shape packs,
    else computed by torch in float32.

    Args:
        linear: the bf16 CPU ``nn.Linear`` to replace; its weight ``[out, in]`` is
            packed where the FMA kernel runs here and the shape fits
            (``in % 32 == 0``, ``out % 16 == 0``), else it and the bias are widened
            to float32 once (exact) for ``F.linear``.

    Forward: ``x [..., in]`` bf16 -> ``[..., out]`` bf16: float32 accumulation of
    the exactly widened operands, rounded to bf16 once (the FMA kernel sums in
    another order than torch's float32 GEMM). No fused SwiGLU (``forward_swiglu``
    is ``None``).

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
    """

    KERNEL_PATH = cpu_ext.LINEAR_FMA
    MAX_PACKED_ROWS = None

    weight32: torch.Tensor | None
    bias32: torch.Tensor | None

    def _keep_dense(self, linear: nn.Linear, packed: bool) -> None:
        """The float32 weight and bias only where no VNNI weight was kept (the
        kernel serves every batch otherwise)."""
        weight32 = None if packed else linear.weight.detach().float().contiguous()
        self.register_buffer("weight32", weight32, persistent=False)
        bias = linear.bias.detach().float() if linear.bias is not None and not packed else None
        self.register_buffer("bias32", bias, persistent=False)

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        """Unpacked: torch's float32 GEMM. Packed: what ``_packed_for`` declined, an
        empty batch (as ``nn.Linear`` gives) or a strided ``x`` (made contiguous for
        the kernel).

        Raises:
            ValueError: a packed layer given a ``x`` that is not bf16.
        """
        if self.weight32 is not None:
            return F.linear(x2.float(), self.weight32, self.bias32).to(x2.dtype)
        if x2.shape[0] == 0:
            return x2.new_empty((0, self.out_features))
        if x2.dtype != torch.bfloat16:
            raise ValueError(f"{type(self).__name__} takes bf16 inputs, got {x2.dtype}")
        assert self.vnni_weight is not None, "a layer without weight32 is packed"
        return cpu_ext.bf16_linear(x2.contiguous(), self.vnni_weight, self.bias,
                                   self.out_features)

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """Always ``None``: the FMA kernel has no fused SwiGLU (the caller runs the
        linear, then ``silu_and_mul``)."""
        return None


def replace_cpu_bf16_linear(module: nn.Linear, batch_invariant: bool = False) -> PackedLinear:
    """A bf16 CPU ``nn.Linear`` made fast on this CPU: a ``PackedLinear`` where torch
    has a native bf16 GEMM, else a ``Float32ComputeLinear`` (see the module docstring);
    ``batch_invariant``: see ``PackedLinear``.

    Raises:
        ValueError: when the layer is not a bf16 CPU ``nn.Linear``.
    """
    cls = PackedLinear if fast_bf16_gemm() else Float32ComputeLinear
    return cls(module, batch_invariant=batch_invariant)


def batch_variant_layers(model: nn.Module) -> list[str]:
    """Names of ``model``'s linear layers whose output for a row may depend on the
    other rows of the batch: plain ``nn.Linear`` (torch's GEMM), and packed layers
    without a ``vnni_weight`` (a shape the kernel does not take) or with a row limit
    (``MAX_PACKED_ROWS``, oneDNN beyond it)."""
    names = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            names.append(name)
        elif isinstance(m, PackedLinear) and (m.vnni_weight is None or m.MAX_PACKED_ROWS):
            names.append(name)
    return names


def pack_linear_layers(model: nn.Module, batch_invariant: bool = False) -> int:
    """Replace every bf16 CPU ``nn.Linear`` of ``model`` by a ``PackedLinear`` (torch
    has a native bf16 GEMM on this CPU) or else a ``Float32ComputeLinear``;
    ``batch_invariant``: see ``PackedLinear``.

    Idempotent (already replaced layers are skipped). Returns the number of layers
    replaced.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, replace_cpu_bf16_linear(child, batch_invariant))
    return len(targets)
