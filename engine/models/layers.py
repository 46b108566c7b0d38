"""Building blocks shared by tandem's native decoders: RMSNorm and the SwiGLU MLP,
written against ``kernels/`` (the packed CPU linears, the native SiLU-and-mul)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import distributed
from tandem.engine.models.interface import IntermediateTensors
from tandem.engine.models.sharding import ModelShard
from tandem.kernels import backend, cpu_ext
from tandem.kernels.backend import KernelBackend
from tandem.kernels.layernorm import rms_norm

__all__ = ["MLP", "RMSNorm", "packed_tied_head", "stage_end", "stage_start"]


class RMSNorm(nn.Module):
    """RMSNorm module holding its weight; see ``kernels/layernorm.py``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))`` over this TP
    rank's ``shard.intermediate_size`` slice (row-parallel ``down``, then the all-reduce)."""

    def __init__(self, config: Any, shard: ModelShard) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        self.intermediate_size: int = shard.intermediate_size
        self.tp_size = shard.tp_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._down(x)
        return distributed.get_tp_group().all_reduce(out) if self.tp_size > 1 else out

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.gate_up_proj, "forward_swiglu", None)
        act = fused(x) if fused is not None else None
        if act is not None:  # packed kernel: projection and SwiGLU in one pass (decode)
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        native = backend.current().for_tensor(gate_up) is KernelBackend.CPU_NATIVE
        act = cpu_ext.silu_and_mul_cpu(gate_up) if native else None
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


def packed_tied_head(weight: torch.Tensor, batch_invariant: bool = False) -> nn.Module | None:
    """A packed LM head over a tied embedding matrix ``weight`` (``[vocab, hidden]``):
    ``PackedLinear`` or ``Float32ComputeLinear`` (``tandem.kernels.linear``), bf16 on the CPU
    only, else ``None``. The embedding is an ``nn.Embedding``, so ``pack_linear_layers``
    never sees the head; the packed copy costs one more embedding matrix of memory."""
    from tandem.kernels.linear import replace_cpu_bf16_linear

    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False) if not isinstance(
        weight, nn.Parameter) else weight
    return replace_cpu_bf16_linear(head, batch_invariant)


def stage_start(
    embedded: torch.Tensor | None, intermediate: IntermediateTensors | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pipeline stage's ``(hidden, residual)`` at its first layer: the embeddings on the
    first stage (``embedded``, ``[num_tokens, hidden_size]``; no residual yet), else what
    the previous stage returned.

    Raises:
        ValueError: a later stage (no ``embedded``) called without ``intermediate``.
    """
    if embedded is not None:
        return embedded, None
    if intermediate is None:
        raise ValueError("intermediate: a later pipeline stage needs the previous one's output")
    return intermediate.hidden, intermediate.residual


def stage_end(
    norm: nn.Module | None, hidden: torch.Tensor, residual: torch.Tensor | None
) -> torch.Tensor | IntermediateTensors:
    """A stage's result after its last layer: the final-norm hidden states on the last
    stage (``norm`` given), else the ``IntermediateTensors`` for the next stage."""
    assert residual is not None, "every stage runs at least one layer"
    if norm is None:
        return IntermediateTensors(hidden, residual)
    hidden, _ = norm(hidden, residual)
    return hidden
