"""Tensor parallelism for the Transformers modeling backend, from the config's TP plan.

transformers' configs declare how their decoder splits over ranks in
``config.base_model_tp_plan``: module-name patterns (``layers.*.self_attn.q_proj``,
``*`` standing for a layer index) mapped to a sharding style. vLLM's Transformers
backend shards from the same plan; here the plan's Megatron-LM styles (Shoeybi et al.
2019) are applied to transformers' ``nn.Linear`` modules by hand (no transformers
tensor-parallel internals):

- ``colwise``: the weight's output features (rows) and the bias split into
  ``tp_size`` equal contiguous parts; rank ``r`` keeps part ``r``. On q/k/v
  projections a part is whole heads, so the attention runs on this rank's heads and the
  paged KV cache holds those heads only.
- ``rowwise``: the weight's input features (columns) split the same way; the module's
  output, a partial sum, is summed over the TP group by a forward hook, and the bias is
  added once after the sum.

Styles whose result equals running the module whole on every rank (``colwise_rep``,
``embedding_rowwise``, ``replicated_with_grad_allreduce``) leave it replicated: the
embedding and the LM head stay whole on every rank. Any other style (gathered or split
activations, MLA's fused latent projection, MoE expert and router styles, sequence
parallel) is refused at load, as is a config without a plan.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tandem.engine import distributed

#: styles that split a linear module across the TP ranks
SHARDED_STYLES = frozenset({"colwise", "rowwise"})

#: styles whose module computes the same output when kept whole on every rank
REPLICATED_STYLES = frozenset({"colwise_rep", "embedding_rowwise",
                               "replicated_with_grad_allreduce"})


def tp_plan(config: Any) -> dict[str, str]:
    """The config's ``base_model_tp_plan`` (pattern -> style), ``{}`` when it has none."""
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def check_tp_plan(config: Any, arch: str, tp_size: int) -> None:
    """Refuse ``tp_size`` ranks for ``config`` unless its plan can be served.

    Args:
        config: the transformers config.
        arch: the architecture name, for the messages.
        tp_size: the TP group's size (> 1).

    Raises:
        ValueError: naming ``tensor_parallel_size`` and ``arch``: the config declares no
            ``base_model_tp_plan``; the plan has a style other than ``SHARDED_STYLES`` and
            ``REPLICATED_STYLES`` (naming the style and its pattern); the plan splits no
            module; ``num_attention_heads`` or ``num_key_value_heads`` is not divisible by
            ``tp_size`` (naming both head counts).
    """
    plan = tp_plan(config)
    if not plan:
        raise ValueError(f"tensor_parallel_size {tp_size}: {arch} declares no tensor-parallel "
                         "plan (config.base_model_tp_plan); the Transformers backend shards "
                         "only from one; use tensor_parallel_size=1")
    for pattern, style in plan.items():
        if style not in SHARDED_STYLES | REPLICATED_STYLES:
            raise ValueError(
                f"tensor_parallel_size {tp_size}: {arch}'s tensor-parallel plan has style "
                f"{style!r} (on {pattern!r}); the Transformers backend serves the styles "
                f"{sorted(SHARDED_STYLES)} (and {sorted(REPLICATED_STYLES)} kept whole); "
                "use tensor_parallel_size=1")
    if not SHARDED_STYLES & set(plan.values()):
        raise ValueError(f"tensor_parallel_size {tp_size}: {arch}'s tensor-parallel plan "
                         "splits no module; use tensor_parallel_size=1")
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads == 0 or heads % tp_size or kv % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide num_attention_heads "
                         f"{heads} and num_key_value_heads {kv} ({arch})")


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


def _part(size: int, tp_rank: int, tp_size: int, what: str) -> slice:
    if size % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must divide {what} {size}")
    n = size // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def _shard_colwise(module: nn.Linear, name: str, tp_rank: int, tp_size: int) -> None:
    rows = _part(module.out_features, tp_rank, tp_size, f"the output features of {name}")
    module.weight = nn.Parameter(module.weight.data[rows].clone(), requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.data[rows].clone(), requires_grad=False)
    module.out_features = rows.stop - rows.start


def _reduce_then_bias(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    """Forward hook of a rowwise module: the partial sums added over the TP group,
    then the whole bias (``tp_bias``; ``None`` without one) added once."""
    out = distributed.get_tp_group().all_reduce(out)
    bias = getattr(module, "tp_bias", None)
    return out if bias is None else out + bias


def _shard_rowwise(module: nn.Linear, name: str, tp_rank: int, tp_size: int) -> None:
    cols = _part(module.in_features, tp_rank, tp_size, f"the input features of {name}")
    module.weight = nn.Parameter(module.weight.data[:, cols].clone(), requires_grad=False)
    bias = module.bias
    # NOTE: the bias leaves the linear (each rank's output is a partial sum) and is added
    # after the all-reduce, so every rank's sum equals the unsplit module's output.
    module.register_parameter("bias", None)
    module.register_buffer("tp_bias", None if bias is None else bias.data.clone())
    module.in_features = cols.stop - cols.start
    module.register_forward_hook(_reduce_then_bias)


def shard_base_model(base: nn.Module, config: Any, arch: str, tp_rank: int,
                     tp_size: int) -> list[str]:
    """Split ``base`` (the transformers base model, e.g. ``LlamaModel``) in place to TP
    rank ``tp_rank``'s part, by the config's plan (``check_tp_plan`` passed).

    Args:
        base: the loaded base model whose module names the plan's patterns match.
        config / arch: its config and architecture name.
        tp_rank / tp_size: this rank and the TP group's size.

    Returns:
        The names of the modules split, in module order.

    Raises:
        ValueError: naming ``tensor_parallel_size``: a pattern with a splitting style
            that matches a parameter instead of a module, or a module that is not an
            ``nn.Linear``; a split dimension ``tp_size`` does not divide.
    """
    modules = dict(base.named_modules())
    params = [n for n, _ in base.named_parameters()]
    done: list[str] = []
    for pattern, style in tp_plan(config).items():
        if style not in SHARDED_STYLES:
            continue
        rx = _regex(pattern)
        names = [n for n in modules if rx.fullmatch(n)]
        if not names and any(rx.fullmatch(p) for p in params):
            raise ValueError(f"tensor_parallel_size {tp_size}: {arch}'s plan splits the "
                             f"parameter {pattern!r} ({style}); the Transformers backend "
                             "splits linear modules only")
        for name in names:
            module = modules[name]
            if not isinstance(module, nn.Linear):
                raise ValueError(f"tensor_parallel_size {tp_size}: {arch}'s plan splits "
                                 f"{name} ({type(module).__name__}, {style}); the "
                                 "Transformers backend splits nn.Linear modules only")
            shard = _shard_colwise if style == "colwise" else _shard_rowwise
            shard(module, name, tp_rank, tp_size)
            done.append(name)
    return sorted(done, key=list(modules).index)
