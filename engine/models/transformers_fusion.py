"""Sibling projections of transformers' modules fused into one GEMM at load.

transformers' decoder layers call one ``nn.Linear`` per projection: a Llama layer runs
q, k, v, o, gate, up and down, seven GEMMs, where tandem's native layers run four (a
fused QKV and a fused gate/up projection, as vLLM's ``QKVParallelLinear`` /
``MergedColumnParallelLinear``). At decode batch sizes each GEMM is a separate native
call over a small weight, so the call count, not the arithmetic, sets much of a step's
time on a CPU.

``fuse_projections`` replaces each group of sibling ``nn.Linear`` children that the
module's forward applies to the same input (``q_proj`` / ``k_proj`` / ``v_proj`` of an
attention module, ``gate_proj`` / ``up_proj`` of a gated MLP) by small ``_Slice``
modules over one ``FusedProjection``: the first sibling called with an input computes
the concatenated product ``x @ [W_q; W_k; W_v].T`` once, every sibling returns its
column slice (a view) of it. The fused ``nn.Linear`` is an ordinary child of the parent
module, so the runner's bf16 packing (``kernels/linear.pack_linear_layers``) packs it
like any other linear.

Whether a module really calls its siblings on one input is learnt, not assumed: a probe
forward runs with the groups installed, and a group whose siblings saw different inputs
(or an input modified in place between them), were called a different number of times,
or a probe that fails with them installed, puts the original linears back. A fused
group stays correct whatever the call pattern (an input it has not cached is computed
afresh); the probe only keeps groups that save work.

Only for one rank: a tensor-parallel split (``transformers_tp.py``) cuts each sibling's
weight by its own plan entry, so the backend fuses only when ``tp_size == 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["FUSIBLE_SIBLINGS", "FusedProjection", "FusionReport", "fuse_projections"]

#: child names whose ``nn.Linear`` s a module applies to one input: attention's
#: query/key/value projections and a gated MLP's gate/up projections
FUSIBLE_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


class FusedProjection(nn.Module):
    """One GEMM for several sibling projections of the same input.

    Args:
        linears: the sibling ``nn.Linear`` s, same ``in_features``, dtype and device,
            all with a bias or none; their weights ``[out_i, in]`` are concatenated
            (in order) into ``linear.weight`` ``[sum(out_i), in]``.

    Attributes:
        linear: the fused ``nn.Linear`` (the runner may replace it by a packed one).
        sizes: ``out_i`` per sibling.
        broken: set when a call pattern did not share the product (see ``part``).

    Raises:
        ValueError: naming ``linears`` when they differ in ``in_features``, dtype,
            device or bias presence.
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        first = linears[0]
        for lin in linears[1:]:
            if (lin.in_features != first.in_features or lin.weight.dtype != first.weight.dtype
                    or lin.weight.device != first.weight.device
                    or (lin.bias is None) != (first.bias is None)):
                raise ValueError("linears: siblings differ in in_features, dtype, device or bias")
        self.sizes = [lin.out_features for lin in linears]
        fused = nn.Linear(first.in_features, sum(self.sizes), bias=first.bias is not None,
                          device="meta", dtype=first.weight.dtype)
        fused.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]),
                                    requires_grad=False)
        if first.bias is not None:
            fused.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]),
                                      requires_grad=False)
        self.linear = fused
        self.broken = False
        self._input: torch.Tensor | None = None
        self._version = 0
        self._parts: tuple[torch.Tensor, ...] = ()
        self._pending: set[int] = set()

    @staticmethod
    def _version_of(x: torch.Tensor) -> int:
        # Inference tensors keep no version counter; the probe (no_grad) checks it.
        return -1 if x.is_inference() else x._version

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``index``'s output ``[..., sizes[index]]`` for ``x [..., in]``: a
        column slice (a view) of the fused product, computed when ``x`` is not the
        input the pending siblings share (then any sibling still pending for the old
        input marks the group ``broken``). The cached product is dropped once every
        sibling has taken its slice."""
        shared = (x is self._input and index in self._pending
                  and self._version_of(x) == self._version)
        if not shared:
            if self._pending:
                self.broken = True
            self._parts = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._version = x, self._version_of(x)
            self._pending = set(range(len(self.sizes)))
        self._pending.discard(index)
        out = self._parts[index]
        if not self._pending:
            self._input, self._parts = None, ()
        return out

    @property
    def complete(self) -> bool:
        """Whether every sibling has taken its slice of the last product."""
        return not self._pending

    def reset(self) -> None:
        """Forget the cached product (and whatever was pending)."""
        self._input, self._parts, self._pending = None, (), set()


class _Slice(nn.Module):
    """Stands in for sibling ``index`` of a ``FusedProjection``: ``x [..., in]`` ->
    ``[..., out_features]``. The fused module is held outside the module tree (it is a
    child of the parent module), so it is packed and counted once."""

    _fused: FusedProjection

    def __init__(self, fused: FusedProjection, index: int, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.index = index
        object.__setattr__(self, "_fused", fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused.part(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"fused part {self.index}"


@dataclass(frozen=True)
class FusionReport:
    """What ``fuse_projections`` did.

    Attributes:
        fused: ``"<module path>:<sibling,...>"`` per group kept fused.
        reverted: the same for groups put back (their call pattern shared nothing).
    """

    fused: tuple[str, ...]
    reverted: tuple[str, ...]


@dataclass
class _Group:
    parent: nn.Module
    path: str
    names: tuple[str, ...]
    originals: list[nn.Linear]
    fused: FusedProjection

    @property
    def attr(self) -> str:
        return "fused_" + "_".join(n.removesuffix("_proj") for n in self.names)

    @property
    def label(self) -> str:
        return f"{self.path}:{','.join(self.names)}"


def _candidates(model: nn.Module) -> list[_Group]:
    groups = []
    for path, parent in model.named_modules():
        children = dict(parent.named_children())
        for names in FUSIBLE_SIBLINGS:
            linears = [children.get(n) for n in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue
            lins = [lin for lin in linears if isinstance(lin, nn.Linear)]
            try:
                fused = FusedProjection(lins)
            except ValueError:
                continue  # siblings that cannot share a GEMM stay as they are
            groups.append(_Group(parent, path, names, lins, fused))
    return groups


def _install(g: _Group) -> None:
    setattr(g.parent, g.attr, g.fused)
    for i, (name, lin) in enumerate(zip(g.names, g.originals, strict=True)):
        setattr(g.parent, name, _Slice(g.fused, i, lin.in_features, lin.out_features))


def _revert(g: _Group) -> None:
    delattr(g.parent, g.attr)
    for name, lin in zip(g.names, g.originals, strict=True):
        setattr(g.parent, name, lin)


def fuse_projections(model: nn.Module, probe: Callable[[], object]) -> FusionReport:
    """Fuse the sibling projections of ``model`` (see the module docstring) and keep
    the groups a probe forward shows sharing their input.

    Args:
        model: a transformers model (its ``nn.Linear`` children are replaced in place);
            only modules with every name of a ``FUSIBLE_SIBLINGS`` entry as a plain
            ``nn.Linear`` child of one ``in_features``, dtype, device and bias presence
            are candidates.
        probe: runs one forward of ``model`` (its result is ignored).

    Returns:
        The ``FusionReport``. Where the probe raises with the groups installed, every
        group is reverted (and the probe's error is logged, not raised: the unfused
        model is what the caller's own probe then checks).
    """
    groups = _candidates(model)
    if not groups:
        return FusionReport((), ())
    for g in groups:
        _install(g)
    try:
        probe()
        failed: Exception | None = None
    except (RuntimeError, ValueError, TypeError) as e:
        failed = e
    kept, reverted = [], []
    for g in groups:
        ok = failed is None and not g.fused.broken and g.fused.complete
        g.fused.reset()
        g.fused.broken = False
        if ok:
            kept.append(g.label)
        else:
            _revert(g)
            reverted.append(g.label)
    if failed is not None:
        logger.info("projection fusion reverted: the probe failed with it (%s)", failed)
    # the originals of kept groups are dropped here: their weights live in the fused one
    return FusionReport(tuple(kept), tuple(reverted))
