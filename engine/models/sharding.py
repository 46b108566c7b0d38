"""Which part of a decoder model one rank holds under tensor and pipeline parallelism.

Tensor parallel as in Megatron-LM (Shoeybi et al. 2019) and vLLM: the fused QKV and
gate/up projections are split by output rows (column-parallel: each rank its query
heads, its KV heads and its slice of the MLP), the output and down projections by
input columns (row-parallel: each rank a partial sum, then an all-reduce), and the
vocabulary of the embedding and the LM head into equal contiguous shards (the
vocabulary padded with zero rows to a multiple of ``tp_size``). Pipeline parallel:
each stage holds a contiguous run of decoder layers (``distributed.pp_layer_range``);
the first also the embedding, the last the final norm and the LM head.

``ModelShard`` is the one description of that split; the model builds its modules
from it and ``shard_hf_tensor`` cuts each Hugging Face tensor to this rank's part.
With one rank every cut is the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import distributed


@dataclass(frozen=True)
class ModelShard:
    """This rank's part of the model.

    Attributes:
        tp_rank / tp_size / pp_rank / pp_size: this rank's place in its TP and PP groups.
        num_heads: query heads held here (``num_attention_heads // tp_size``); they are
            the full model's heads ``[tp_rank * num_heads, (tp_rank + 1) * num_heads)``.
        kv_heads: the full model's KV heads held here (``distributed.kv_head_range``).
        head_dim: elements of one head.
        intermediate_size: MLP width held here (``intermediate_size // tp_size``).
        layers: the full model's decoder layers this stage runs.
        vocab_size: the full vocabulary.
        vocab_per_rank: rows of the local embedding / LM head shard
            (``ceil(vocab_size / tp_size)``); the shard covers token ids
            ``[vocab_start, vocab_end)``, the rows beyond are zero padding.
    """

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    num_heads: int
    kv_heads: range
    head_dim: int
    intermediate_size: int
    layers: range
    vocab_size: int
    vocab_per_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def vocab_start(self) -> int:
        return self.tp_rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)

    def check_ranks(self, tp: distributed.GroupCoordinator,
                    pp: distributed.GroupCoordinator) -> None:
        """Raises: ValueError when this shard is not the one of this process's ranks in
        its TP group ``tp`` and PP group ``pp`` (a model loaded for other ranks)."""
        if (self.tp_rank, self.tp_size, self.pp_rank, self.pp_size) != (
            tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size
        ):
            raise ValueError(
                f"loaded: the model was built for TP rank {self.tp_rank}/{self.tp_size}, "
                f"PP rank {self.pp_rank}/{self.pp_size}, not for this process's "
                f"{tp.rank_in_group}/{tp.world_size}, {pp.rank_in_group}/{pp.world_size}"
            )

    @staticmethod
    def of(config: Any, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> ModelShard:
        """The shard of rank ``(tp_rank, pp_rank)`` of a model with transformers config
        ``config`` (Llama family fields).

        Raises:
            ValueError: naming ``tensor_parallel_size`` when it does not divide
                ``num_attention_heads`` or ``intermediate_size``, or when
                ``num_key_value_heads`` is neither divisible by it nor divides it;
                naming ``pipeline_parallel_size`` when it exceeds ``num_hidden_layers``.
        """
        heads = int(config.num_attention_heads)
        if tp_size < 1 or heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide num_attention_heads {heads}"
            )
        ffn = int(config.intermediate_size)
        if ffn % tp_size:
            raise ValueError(f"tensor_parallel_size {tp_size} must divide intermediate_size {ffn}")
        kv_heads = distributed.kv_head_range(tp_rank, tp_size, int(config.num_key_value_heads))
        layers = distributed.pp_layer_range(pp_rank, pp_size, int(config.num_hidden_layers))
        vocab = int(config.vocab_size)
        return ModelShard(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            num_heads=heads // tp_size,
            kv_heads=kv_heads,
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            intermediate_size=ffn // tp_size,
            layers=layers,
            vocab_size=vocab,
            vocab_per_rank=-(-vocab // tp_size),
        )

    @staticmethod
    def current(config: Any) -> ModelShard:
        """The shard of this process under its parallel state (``engine/distributed.py``;
        the whole model before ``init_distributed``). Raises as ``of``."""
        tp, pp = distributed.get_tp_group(), distributed.get_pp_group()
        return ModelShard.of(config, tp.rank_in_group, tp.world_size, pp.rank_in_group,
                             pp.world_size)

    def holds_hf_weight(self, name: str) -> bool:
        """Whether HF weight ``name`` has a part on this pipeline stage (every weight
        has one on every TP rank); the copy of a tied embedding a later stage may keep
        as its LM head is the model's business."""
        parts = name.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"]:
            return int(parts[2]) in self.layers
        if name.startswith("model.embed_tokens."):
            return self.is_first_stage
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last_stage
        return True

    def shard_hf_tensor(self, module: str, kind: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of the HF tensor ``<...>.<module>.<kind>`` (``kind``:
        "weight" or "bias"), e.g. ``("q_proj", "weight")``: the rows of its heads for
        q/k/v, of its MLP slice for gate/up, the columns of its heads / slice for o/down,
        the rows ``[vocab_start, vocab_end)`` zero-padded to ``vocab_per_rank`` for the
        embedding and LM head. A row-parallel bias (o/down) is whole on TP rank 0 and
        zero elsewhere, so the all-reduce adds it once. Other tensors (norms) whole."""
        if module in ("embed_tokens", "lm_head"):
            if self.vocab_per_rank == self.vocab_size:
                return t
            part = t.new_zeros((self.vocab_per_rank, *t.shape[1:]))
            part[: self.vocab_end - self.vocab_start] = t[self.vocab_start : self.vocab_end]
            return part
        if self.tp_size == 1:
            return t
        d = self.head_dim
        if module == "q_proj":
            h0 = self.tp_rank * self.num_heads
            return t[h0 * d : (h0 + self.num_heads) * d]
        if module in ("k_proj", "v_proj"):
            return t[self.kv_heads.start * d : self.kv_heads.stop * d]
        if module in ("gate_proj", "up_proj"):
            i0 = self.tp_rank * self.intermediate_size
            return t[i0 : i0 + self.intermediate_size]
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return t if self.tp_rank == 0 else torch.zeros_like(t)
            width = self.num_heads * d if module == "o_proj" else self.intermediate_size
            c0 = self.tp_rank * width
            return t[:, c0 : c0 + width]
        return t


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary shard (Megatron-LM's
    ``VocabParallelEmbedding``): ids outside ``[vocab_start, vocab_end)`` look up a zero
    row, and the TP all-reduce adds the one rank that holds each id (exactly: the other
    terms are zeros).

    Args:
        shard: this rank's ``ModelShard``.
        hidden_size: embedding width.

    Attributes:
        weight: ``[vocab_per_rank, hidden_size]`` (the rows past ``vocab_end`` are zero).

    Forward: ``ids [num_tokens]`` int64 -> ``[num_tokens, hidden_size]`` in the weight's dtype.
    """

    def __init__(self, shard: ModelShard, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, hidden_size))
        self.vocab_start, self.vocab_end = shard.vocab_start, shard.vocab_end
        self.tp_size = shard.tp_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return distributed.get_tp_group().all_reduce(out)


class PPMissingLayer(nn.Identity):
    """Stands in for a decoder layer another pipeline stage runs, so the layer list
    keeps the full model's indices (and HF weight names) on every stage."""
