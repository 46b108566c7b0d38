"""DeepSeek-V2 / V3 (and Kimi-K2, a V3 checkpoint) decoders with multi-head latent attention.

Architecture as in transformers' ``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py``:
pre-norm decoder layers of RMSNorm -> MLA self-attention (``engine/models/mla.py``: the
paged cache holds each token's compressed latent and rotary key, the up-projections are
absorbed into the query and the output) -> residual add -> RMSNorm -> MLP -> residual add;
a final RMSNorm and the LM head. Layers ``< first_k_dense_replace`` have a dense SwiGLU
MLP; the later ones a mixture of experts with shared experts and DeepSeek's routing
(V2: softmax, greedy or group-limited; V3: sigmoid, score-correction bias, group top-2),
tandem's native block (``engine/models/moe.py``: ``SparseMoeBlock`` with
``MoESpec.deepseek``).

One rank only for now: the latent is shared by every head, so tensor parallelism would
replicate it on every rank (as vLLM does) and split the heads; that split is not written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.interface import IntermediateTensors, KVCacheViews
from tandem.engine.models.layers import MLP, RMSNorm
from tandem.engine.models.llama import DecoderLayer
from tandem.engine.models.mla import MLAAttention, MLARotary
from tandem.engine.models.moe import MoESpec, SparseMoeBlock
from tandem.engine.models.sharding import ModelShard, VocabParallelEmbedding
from tandem.kernels.attention import AttentionMetadata


def is_moe_layer(config: Any, layer: int) -> bool:
    """Whether ``layer``'s MLP is a mixture of experts: ``layer >= first_k_dense_replace``
    (transformers' DeepSeek-V2/V3 rule)."""
    return layer >= int(getattr(config, "first_k_dense_replace", 0) or 0)


class DeepseekDecoderLayer(DecoderLayer):
    """One DeepSeek decoder layer: Llama's pre-norm residual layout with MLA attention and a
    dense or MoE MLP."""

    def __init__(self, config: Any, shard: ModelShard, layer: int, interleaved: bool,
                 moe: bool) -> None:
        mlp: nn.Module = (SparseMoeBlock(config, shard, MoESpec.deepseek(config)) if moe
                          else MLP(config, shard))
        super().__init__(config, shard, qkv_bias=False, qk_norm=False, sliding_window=None,
                         mlp=mlp, attn=MLAAttention(config, interleaved))


class DeepseekModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` prefix)."""

    def __init__(self, config: Any, shard: ModelShard, interleaved: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, shard, i, interleaved, is_moe_layer(config, i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 causal LM with MLA over the paged latent cache.

    Construct with ``build_model`` (``engine/models/registry.py``), which skips random
    initialisation and loads HF weights. The runner's cache for it is
    ``KVCacheSpec.mla(kv_lora_rank, qk_rope_head_dim)`` (``model_facts.kv_cache_spec``):
    ``[num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]``.

    Args:
        config: a transformers ``DeepseekV2Config`` / ``DeepseekV3Config`` (or compatible).
        max_position: length of the rotary tables in tokens.
        dtype / device: of the rotary tables (weights follow the module's own).

    Attributes:
        shard: the whole model (one rank), with one KV "head" of the latent's width.

    Raises:
        ValueError: naming ``tensor_parallel_size`` / ``pipeline_parallel_size`` above 1
            (not implemented for MLA), an unsupported rope type or a non-silu activation.
    """

    #: DeepSeek-V2 rotates interleaved pairs (always); V3 by ``config.rope_interleave``
    interleave_default = True

    def __init__(
        self,
        config: Any,
        max_position: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        shard = ModelShard.current(config)
        if shard.tp_size > 1 or shard.pp_size > 1:
            name = "tensor_parallel_size" if shard.tp_size > 1 else "pipeline_parallel_size"
            raise ValueError(f"{name} {max(shard.tp_size, shard.pp_size)}: tandem's native "
                             f"MLA model ({type(self).__name__}) runs on one rank; use 1")
        width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        # The cache holds one latent "head" per token (KVCacheSpec.mla); the runner reads
        # the cached heads from the shard.
        self.shard = dataclasses.replace(shard, kv_heads=range(1), head_dim=width)
        self.interleaved = bool(getattr(config, "rope_interleave", self.interleave_default))
        self.model = DeepseekModel(config, self.shard, self.interleaved)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (None if self.tie_word_embeddings
                        else nn.Linear(config.hidden_size, shard.vocab_per_rank, bias=False))
        self.tied_lm_head: nn.Module | None = None
        self.rotary = MLARotary(config, max_position, dtype, device)

    @property
    def max_position(self) -> int:
        """Positions (tokens) the rotary tables cover."""
        return int(self.rotary.max_position)

    def ensure_max_position(self, max_position: int) -> None:
        """Rebuild the rotary tables for ``max_position`` tokens when they cover fewer."""
        if max_position > self.rotary.max_position:
            old = self.rotary.cos
            self.rotary = MLARotary(self.config, max_position, old.dtype, old.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheViews],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The decoder over the step's flattened tokens (``CausalLM.forward``; one stage).

        Args:
            input_ids / positions: ``[num_tokens]`` int64.
            kv_caches: per layer the latent cache views (``kv_cache_layer_views`` of a
                one-component cache), each ``[num_blocks, block_size, 1, kv_lora_rank +
                qk_rope_head_dim]``; the new tokens' entries are written into them.
            attn_metadata: the step's ``AttentionMetadata``.
            intermediate: unused (one pipeline stage).

        Returns:
            ``[num_tokens, hidden_size]`` final-norm hidden states (model dtype).
        """
        cos_sin = self.rotary.cos_sin(positions)
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos_sin, kv_cache, attn_metadata)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def _head(self) -> nn.Module | None:
        return self.lm_head if self.lm_head is not None else self.tied_lm_head

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """``[num_seqs, hidden]`` -> ``[num_seqs, vocab_size]`` logits (float32, or the
        head's dtype with ``upcast=False``)."""
        head = self._head()
        logits = head(hidden) if head is not None else F.linear(
            hidden, self.model.embed_tokens.weight)
        return logits.float() if upcast else logits

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[num_seqs]`` int64 argmax from a packed head's ``forward_argmax``, else None."""
        forward_argmax = getattr(self._head(), "forward_argmax", None)
        return forward_argmax(hidden) if forward_argmax is not None else None

    def pack_tied_lm_head(self, batch_invariant: bool = False) -> bool:
        """A packed copy of a tied bf16 CPU head (``LlamaForCausalLM.pack_tied_lm_head``);
        returns whether one was made."""
        from tandem.kernels.linear import replace_cpu_bf16_linear

        weight = self.model.embed_tokens.weight
        if (self.lm_head is not None or self.tied_lm_head is not None
                or weight.dtype != torch.bfloat16 or weight.device.type != "cpu"):
            return False
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = weight
        self.tied_lm_head = replace_cpu_bf16_linear(head, batch_invariant)
        return True

    #: HF MLP name -> (our fused parameter, part)
    _stacked = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face DeepSeek state dict into the parameters (gate and up into the
        fused ``gate_up_proj``; every other tensor by its own name).

        Layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer,
        ``model.layers.61.*``) and rotary buffers are skipped, as transformers does.

        Raises:
            ValueError: naming the tensor, for an unexpected name or a shape mismatch;
                naming the parameters the checkpoint left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        moe_done: set[str] = set()  # SparseMoeBlock.load_hf's names, under the layer's prefix
        moe_blocks = {f"model.layers.{i}.mlp": m.mlp for i, m in enumerate(self.model.layers)
                      if isinstance(m.mlp, SparseMoeBlock)}
        n_layers = int(self.config.num_hidden_layers)
        for name, tensor in weights:
            parts = name.split(".")
            if "rotary_emb" in name:
                continue
            if parts[:2] == ["model", "layers"] and len(parts) > 2 and int(parts[2]) >= n_layers:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            block = moe_blocks.get(".".join(parts[:4]))
            if block is not None and len(parts) > 4:
                try:
                    done = block.load_hf(".".join(parts[4:]), tensor)
                except ValueError as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
                moe_done.update(f"{'.'.join(parts[:4])}.{n}" for n in done)
                continue
            target, part = name, None
            if len(parts) >= 2 and parts[-2] in self._stacked:
                fused, part = self._stacked[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            dst: torch.Tensor = param
            if part is not None:
                half = param.shape[0] // 2
                dst = param[part * half : (part + 1) * half]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if part is None else f"{target}#{part}")
        missing = [p for p in params if not _loaded(p, loaded | moe_done)]
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")


def _loaded(param: str, names: set[str]) -> bool:
    """Whether ``param`` was filled: by its name, as both halves (``#0``, ``#1``) of a fused
    gate/up, or (a MoE router's ``e_score_correction_bias``) under the ``gate.`` name
    ``SparseMoeBlock.load_hf`` reports; ``shared_experts`` is the block's ``shared_expert``."""
    names = names | {n.replace("shared_experts", "shared_expert") for n in names}
    head, _, last = param.rpartition(".")
    return (param in names or {f"{param}#0", f"{param}#1"} <= names
            or f"{head}.gate.{last}" in names)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and Kimi-K2): as V2, its rotary interleaving set by
    ``config.rope_interleave`` (default True); see ``DeepseekV2ForCausalLM``."""
