"""The sparse mixture-of-experts block shared by tandem's native MoE families.

A block is a router (``gate``: ``[num_experts, hidden]`` logits, optionally a bias and
DeepSeek-V3's ``e_score_correction_bias``), the routed experts (``FusedMoE``: every
expert's gate/up rows stacked ``w13 [E, 2I, hidden]`` and down ``w2 [E, hidden, I]``,
run by ``kernels/moe.fused_experts``) and optional shared experts that every token goes
through (Qwen2-MoE's ``shared_expert`` with its sigmoid ``shared_expert_gate``,
DeepSeek's ``shared_experts``). ``MoESpec`` says how a family routes and activates.

Parallelism over the TP group (``ExpertShard``):

- tensor parallel (the default): every rank holds every expert's slice of the
  intermediate dimension, as the dense MLP (Megatron-LM's split);
- expert parallel (``ParallelConfig.enable_expert_parallel``, vLLM's
  ``--enable-expert-parallel``): rank r holds experts ``[r * E / tp, (r + 1) * E / tp)``
  whole. Every rank has every token (attention's all-reduce leaves the hidden states
  replicated), so each computes its own experts' share of each token and the block's
  all-reduce sums the shares (the exchange vLLM does with an all-reduce when EP spans the
  TP group without data parallelism).

Either way the routed and shared partial sums are added first, then one all-reduce.

Reuse (DeepSeek-V2/V3 with MLA attention, built in ``engine/models/mla*.py``): build
``SparseMoeBlock(config, shard, MoESpec.deepseek(config))`` as the layer's ``mlp`` (layers
below ``first_k_dense_replace`` keep the dense ``MLP``) and route the layer's
``mlp.*`` checkpoint tensors to ``block.load_hf(suffix, tensor)``; ``load_hf`` takes
``gate.weight``, ``gate.e_score_correction_bias``, ``experts.<i>.{gate,up,down}_proj.weight``
and ``shared_experts.*``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.engine import distributed
from tandem.engine.models.layers import MLP
from tandem.engine.models.sharding import ModelShard
from tandem.kernels.moe import fused_experts, select_experts


@dataclass(frozen=True)
class ExpertShard:
    """Which experts, and which part of each, this TP rank holds.

    Attributes:
        num_experts: experts of the full model.
        start / stop: global ids of the experts held here (all of them without EP).
        intermediate_size: rows of each held expert's gate (and up) held here
            (``I / tp_size`` without EP, ``I`` with it).
        offset: first intermediate row held here (0 with EP).
        tp_rank / tp_size: this rank in its TP group.
        expert_parallel: whether experts are split whole (EP) rather than sliced (TP).
    """

    num_experts: int
    start: int
    stop: int
    intermediate_size: int
    offset: int
    tp_rank: int
    tp_size: int
    expert_parallel: bool

    @staticmethod
    def of(
        num_experts: int, intermediate: int, tp_rank: int, tp_size: int, expert_parallel: bool
    ) -> ExpertShard:
        """The shard of TP rank ``tp_rank`` of ``tp_size``.

        Raises:
            ValueError: naming ``enable_expert_parallel`` when ``tp_size`` does not divide
                ``num_experts``; naming ``tensor_parallel_size`` when (without EP) it
                does not divide the expert intermediate size.
        """
        if expert_parallel and tp_size > 1:
            if num_experts % tp_size:
                raise ValueError(
                    f"enable_expert_parallel: num_experts {num_experts} must be divisible by "
                    f"tensor_parallel_size {tp_size} (each rank holds num_experts / "
                    "tensor_parallel_size experts)"
                )
            per = num_experts // tp_size
            return ExpertShard(num_experts, tp_rank * per, (tp_rank + 1) * per, intermediate, 0,
                               tp_rank, tp_size, True)
        if intermediate % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide the experts' intermediate size "
                f"{intermediate} (or set enable_expert_parallel)"
            )
        part = intermediate // tp_size
        return ExpertShard(num_experts, 0, num_experts, part, tp_rank * part, tp_rank, tp_size,
                           False)

    @property
    def num_local(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class MoESpec:
    """How one family's sparse block routes and activates (see ``kernels/moe.py``).

    Attributes:
        num_experts / top_k / intermediate_size: routed experts, experts per token, and
            each expert's intermediate width.
        scoring / renormalize / softmax_after_topk / n_group / topk_group / group_score /
            routed_scaling_factor: ``select_experts``'s switches.
        correction_bias: the router has DeepSeek-V3's ``e_score_correction_bias``.
        router_bias / expert_bias: the router and the experts have biases (gpt-oss).
        activation / alpha / limit: ``fused_experts``'s activation.
        shared_intermediate: width of the shared expert(s) (0: none).
        shared_gate: a sigmoid ``shared_expert_gate`` scales the shared output (Qwen2-MoE).
        router_float32: route from float32 hidden states and weights (DeepSeek).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    renormalize: bool = False
    softmax_after_topk: bool = False
    n_group: int | None = None
    topk_group: int | None = None
    group_score: str = "top2_sum"
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    shared_intermediate: int = 0
    shared_gate: bool = False
    router_float32: bool = False

    @staticmethod
    def qwen_moe(config: Any) -> MoESpec:
        """Qwen2-MoE / Qwen3-MoE: softmax, ``norm_topk_prob``; Qwen2-MoE's gated shared expert."""
        return MoESpec(int(config.num_experts), int(config.num_experts_per_tok),
                       int(config.moe_intermediate_size),
                       renormalize=bool(getattr(config, "norm_topk_prob", False)),
                       shared_intermediate=int(
                           getattr(config, "shared_expert_intermediate_size", 0) or 0),
                       shared_gate=bool(getattr(config, "shared_expert_intermediate_size", 0)))

    @staticmethod
    def mixtral(config: Any) -> MoESpec:
        """Mixtral: softmax over all experts, top-k, always renormalised."""
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok),
                       int(config.intermediate_size), renormalize=True)

    @staticmethod
    def gpt_oss(config: Any) -> MoESpec:
        """gpt-oss: softmax over the top-k logits, router and expert biases, clamped SwiGLU."""
        return MoESpec(int(config.num_local_experts), int(config.num_experts_per_tok),
                       int(config.intermediate_size), softmax_after_topk=True,
                       router_bias=True, expert_bias=True, activation="swiglu_oai",
                       alpha=float(getattr(config, "swiglu_alpha", 1.702) or 1.702),
                       limit=float(getattr(config, "swiglu_limit", 7.0) or 7.0))

    @staticmethod
    def deepseek(config: Any) -> MoESpec:
        """DeepSeek-V2 (softmax, ``topk_method`` greedy or group_limited_greedy) and V3
        (``noaux_tc``: sigmoid, score-correction bias, group top-2 sums, renormalised)."""
        v3 = getattr(config, "model_type", "") == "deepseek_v3" or getattr(
            config, "topk_method", None) == "noaux_tc"
        grouped = v3 or getattr(config, "topk_method", None) == "group_limited_greedy"
        return MoESpec(int(config.n_routed_experts), int(config.num_experts_per_tok),
                       int(config.moe_intermediate_size),
                       scoring="sigmoid" if v3 else "softmax",
                       renormalize=bool(getattr(config, "norm_topk_prob", False)) and v3,
                       n_group=int(config.n_group or 1) if grouped else None,
                       topk_group=int(config.topk_group or 1) if grouped else None,
                       group_score="top2_sum" if v3 else "max",
                       routed_scaling_factor=float(config.routed_scaling_factor or 1.0),
                       correction_bias=v3,
                       shared_intermediate=int(config.moe_intermediate_size)
                       * int(getattr(config, "n_shared_experts", 0) or 0),
                       router_float32=True)


class FusedMoE(nn.Module):
    """The routed experts held by this rank, stacked for ``fused_experts``.

    Attributes:
        w13: ``[E_local, 2 * I_local, hidden]``: gate rows then up rows of each expert.
        w2: ``[E_local, hidden, I_local]``.
        w13_bias / w2_bias: ``[E_local, 2 * I_local]`` / ``[E_local, hidden]`` (gpt-oss) or
            absent. Under TP (no EP) ``w2_bias`` is whole on TP rank 0 and zero elsewhere,
            so the all-reduce adds it once.
    """

    def __init__(self, hidden: int, spec: MoESpec, part: ExpertShard) -> None:
        super().__init__()
        self.spec, self.part = spec, part
        e, i = part.num_local, part.intermediate_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, i))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i)) if spec.expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, hidden)) if spec.expert_bias else None
        self._filled: dict[str, set[int]] = {}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, ``weights / ids [T, top_k]`` -> this rank's partial sum
        ``[T, hidden]`` (its experts, its intermediate slice)."""
        s = self.spec
        return fused_experts(x, self.w13, self.w2, weights, ids, w13_bias=self.w13_bias,
                             w2_bias=self.w2_bias, activation=s.activation, alpha=s.alpha,
                             limit=s.limit, expert_start=self.part.start)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's intermediate rows of a ``[I, ...]`` tensor."""
        return t[self.part.offset : self.part.offset + self.part.intermediate_size]

    def load_expert(self, kind: str, expert: int, t: torch.Tensor) -> bool:
        """Copy one expert's HF tensor: ``kind`` "gate" / "up" ``[I, hidden]``, "down"
        ``[hidden, I]``. Returns False (nothing copied) for an expert another rank holds.

        Raises:
            ValueError: on a shape mismatch or an expert id out of range (the caller
                names the tensor).
        """
        if not 0 <= expert < self.part.num_experts:
            raise ValueError(f"expert {expert} out of range [0, {self.part.num_experts})")
        if not self.part.start <= expert < self.part.stop:
            return False
        e, i = expert - self.part.start, self.part.intermediate_size
        if kind == "down":
            src, dst = t[:, self.part.offset : self.part.offset + i], self.w2.data[e]
        else:
            off = 0 if kind == "gate" else i
            src, dst = self._rows(t), self.w13.data[e, off : off + i]
        if src.shape != dst.shape:
            raise ValueError(f"shape {tuple(t.shape)} does not fit {kind} of an expert "
                             f"(this rank's part {tuple(dst.shape)})")
        dst.copy_(src)
        self._filled.setdefault(kind, set()).add(expert)
        return True

    def load_stacked(self, kind: str, t: torch.Tensor) -> None:
        """Copy a tensor holding every expert: "gate_up" ``[E, 2I, hidden]`` (gate then
        up), "down" ``[E, hidden, I]``, "gate_up_bias" ``[E, 2I]``, "down_bias"
        ``[E, hidden]``; gpt-oss's layouts are converted by its model first.

        Raises:
            ValueError: on a shape mismatch.
        """
        p = self.part
        t = t[p.start : p.stop]
        i = p.intermediate_size
        if t.shape[0] != p.num_local:
            raise ValueError(f"shape {tuple(t.shape)}: expected {p.num_experts} experts")
        if kind in ("gate_up", "gate_up_bias"):
            full = t.shape[1] // 2
            gate, up = t[:, :full], t[:, full:]
            src = torch.cat([gate[:, p.offset : p.offset + i], up[:, p.offset : p.offset + i]], 1)
            dst = self.w13 if kind == "gate_up" else self.w13_bias
        elif kind == "down":
            src, dst = t[:, :, p.offset : p.offset + i], self.w2
        elif kind == "down_bias":
            keep = p.expert_parallel or p.tp_rank == 0
            src, dst = (t if keep else torch.zeros_like(t)), self.w2_bias
        else:
            raise ValueError(f"unknown stacked expert tensor kind {kind!r}")
        if dst is None or src.shape != dst.shape:
            want = None if dst is None else tuple(dst.shape)
            raise ValueError(f"shape {tuple(t.shape)} does not fit (this rank's part {want})")
        dst.data.copy_(src)
        for part in ("gate", "up") if kind == "gate_up" else (kind,):
            self._filled[part] = set(range(p.start, p.stop))

    def complete(self) -> list[str]:
        """Names of the parameters (``w13``, ``w2``, biases) that every held expert filled."""
        need = set(range(self.part.start, self.part.stop))
        have = {k: v >= need for k, v in self._filled.items()}
        done = []
        if have.get("gate") and have.get("up"):
            done.append("w13")
        if have.get("down"):
            done.append("w2")
        done += [b for b in ("w13_bias", "w2_bias") if have.get(b.replace("w13", "gate_up")
                                                                .replace("w2", "down"))]
        return done


class SparseMoeBlock(nn.Module):
    """Router, routed experts and optional shared experts: ``[T, hidden] -> [T, hidden]``,
    all-reduced over the TP group (see the module docstring).

    Args:
        config: the transformers config (``hidden_size``, ``hidden_act``).
        shard: this rank's ``ModelShard``.
        spec: the family's ``MoESpec``.
        expert_parallel: hold experts whole (EP) instead of slices; ``None`` reads
            ``distributed.expert_parallel_enabled()``.

    Raises:
        ValueError: from ``ExpertShard.of`` (sizes that do not divide).
    """

    def __init__(self, config: Any, shard: ModelShard, spec: MoESpec,
                 expert_parallel: bool | None = None) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        ep = distributed.expert_parallel_enabled() if expert_parallel is None else expert_parallel
        self.spec = spec
        self.tp_size = shard.tp_size
        self.part = ExpertShard.of(spec.num_experts, spec.intermediate_size, shard.tp_rank,
                                   shard.tp_size, ep)
        self.gate = nn.Linear(hidden, spec.num_experts, bias=spec.router_bias)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(spec.num_experts)) if spec.correction_bias else None)
        self.experts = FusedMoE(hidden, spec, self.part)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_intermediate:
            if spec.shared_intermediate % shard.tp_size:
                raise ValueError(f"tensor_parallel_size {shard.tp_size} must divide the shared "
                                 f"experts' intermediate size {spec.shared_intermediate}")
            self.shared_expert = MLP(config, dataclasses.replace(
                shard, intermediate_size=spec.shared_intermediate // shard.tp_size))
            if spec.shared_gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> ``(weights, ids)`` ``[T, top_k]`` (``select_experts``)."""
        s = self.spec
        if s.router_float32:
            logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        return select_experts(
            logits, s.top_k, scoring=s.scoring, renormalize=s.renormalize,
            softmax_after_topk=s.softmax_after_topk, n_group=s.n_group,
            topk_group=s.topk_group, group_score=s.group_score,
            correction_bias=self.e_score_correction_bias,
            routed_scaling_factor=s.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert._down(x)  # this rank's partial sum, reduced below
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return distributed.get_tp_group().all_reduce(out) if self.tp_size > 1 else out

    # HF suffixes (after ``...mlp.``) of the per-expert tensors -> kind
    _EXPERT_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
                     "w1": "gate", "w3": "up", "w2": "down"}
    _STACKED_KINDS = {"gate_up_proj": "gate_up", "down_proj": "down",
                      "gate_up_proj_bias": "gate_up_bias", "down_proj_bias": "down_bias"}

    def load_hf(self, suffix: str, t: torch.Tensor) -> list[str]:
        """Copy this rank's part of the tensor at ``mlp.<suffix>`` of the layer; returns the
        names (relative to this block) of parameters now fully loaded.

        Takes ``gate.weight`` / ``gate.bias`` / ``gate.e_score_correction_bias``,
        ``experts.<i>.{gate_proj,up_proj,down_proj,w1,w3,w2}.weight`` (per expert, as HF
        checkpoints store them), ``experts.{gate_up_proj,down_proj}[_bias]`` (stacked, as
        transformers 5 holds them in memory), ``shared_expert(s).{gate,up,down}_proj.weight``
        and ``shared_expert_gate.weight``.

        Raises:
            ValueError: an unexpected suffix or a shape that does not fit (the caller
                prefixes the tensor's name).
        """
        parts = suffix.split(".")
        if parts[0] == "experts":
            if len(parts) == 4 and parts[1].isdigit() and parts[2] in self._EXPERT_KINDS:
                self.experts.load_expert(self._EXPERT_KINDS[parts[2]], int(parts[1]), t)
            elif len(parts) == 2 and parts[1] in self._STACKED_KINDS:
                self.experts.load_stacked(self._STACKED_KINDS[parts[1]], t)
            else:
                raise ValueError("unexpected expert tensor")
            return [f"experts.{n}" for n in self.experts.complete()]
        if suffix == "gate.e_score_correction_bias" and self.e_score_correction_bias is not None:
            target: torch.Tensor = self.e_score_correction_bias
        elif parts[0] == "gate" and len(parts) == 2:
            target = getattr(self.gate, parts[1], None)  # type: ignore[assignment]
        elif suffix == "shared_expert_gate.weight" and self.shared_expert_gate is not None:
            target = self.shared_expert_gate.weight
        elif parts[0] in ("shared_expert", "shared_experts") and self.shared_expert is not None:
            return self._load_shared(parts[1], parts[2], t)
        else:
            raise ValueError("unexpected MoE tensor")
        if target is None or target.shape != t.shape:
            raise ValueError(f"shape {tuple(t.shape)}, expected "
                             f"{None if target is None else tuple(target.shape)}")
        target.data.copy_(t)
        return [suffix.replace("shared_experts", "shared_expert")]

    def _load_shared(self, module: str, kind: str, t: torch.Tensor) -> list[str]:
        mlp = self.shared_expert
        assert mlp is not None
        i, r = mlp.intermediate_size, self.part.tp_rank
        if module in ("gate_proj", "up_proj"):
            off = 0 if module == "gate_proj" else i
            src, dst = t[r * i : (r + 1) * i], getattr(mlp.gate_up_proj, kind)[off : off + i]
            name = f"shared_expert.gate_up_proj.{kind}#{0 if module == 'gate_proj' else 1}"
        elif module == "down_proj":
            src, dst = t[:, r * i : (r + 1) * i], mlp.down_proj.weight
            name = "shared_expert.down_proj.weight"
        else:
            raise ValueError("unexpected shared expert tensor")
        if src.shape != dst.shape:
            raise ValueError(f"shape {tuple(t.shape)} does not fit (this rank's part "
                             f"{tuple(dst.shape)})")
        dst.data.copy_(src)
        return [name]
