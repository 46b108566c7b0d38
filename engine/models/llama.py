"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama) written against ``kernels/``.

Architecture as in transformers' ``modeling_llama.py`` (Touvron et al. 2023):
pre-norm decoder layers of RMSNorm -> GQA self-attention with rotary embedding ->
residual add -> RMSNorm -> SwiGLU MLP -> residual add; a final RMSNorm; an LM
head (tied to the embedding when ``tie_word_embeddings``). Q/K/V and gate/up
projections are fused into one matmul each (fewer ops per step); the HF state
dict is mapped onto the fused weights by ``load_weights``.

Subclasses switch on the variations: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3),
sliding-window attention (Mistral, or per ``config.layer_types``).

Under tensor / pipeline parallelism (``engine/distributed.py``) the model is built for
this process's rank: its heads, MLP slice and vocabulary shard, its stage's layers
(``engine/models/sharding.py``); the row-parallel projections and the embedding end
in a TP all-reduce, the LM head's logits are gathered on TP rank 0. With one rank
(the default) every shard is the whole model and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import distributed
from tandem.engine.model_facts import head_dim_of, rope_params
from tandem.engine.models.fused_path import FusedDecodePath, FusedLayer
from tandem.engine.models.interface import IntermediateTensors, KVCacheViews
from tandem.engine.models.layers import (
    MLP,
    RMSNorm,
    packed_tied_head,
    stage_end,
    stage_start,
)
from tandem.engine.models.sharding import ModelShard, PPMissingLayer, VocabParallelEmbedding
from tandem.engine.quantization.base import is_quant_param, load_quant_part
from tandem.kernels.attention import AttentionMetadata, paged_attention
from tandem.kernels.cache import reshape_and_cache
from tandem.kernels.fused_decode import FusedDecode
from tandem.kernels.rotary import RotaryEmbedding, rotary_embedding


class Attention(nn.Module):
    """GQA self-attention over the paged KV cache, over this TP rank's heads
    (``shard.num_heads`` query heads, ``shard.kv_heads``); the output projection is
    row-parallel (a partial sum per rank, then the TP all-reduce)."""

    def __init__(
        self,
        config: Any,
        shard: ModelShard,
        qkv_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
    ) -> None:
        super().__init__()
        self.num_heads: int = shard.num_heads
        self.num_kv_heads: int = len(shard.kv_heads)
        self.tp_size = shard.tp_size
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        out_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias or out_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=out_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # Per-head sink logits ``[num_heads]`` of this rank's heads (gpt-oss sets them).
        self.sinks: nn.Parameter | None = None
        self.softcap: float | None = None  # Gemma 2's attention logit softcapping
        # An FP8 KV cache's per-tensor scales (kernels/kv_quant.py): 1.0 unless calibrated.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCacheViews,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = cos_sin
        q, k = rotary_embedding(q, k, cos, sin)
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, (meta.block_idx, meta.block_offset),
                          self.k_scale, self.v_scale)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                            sinks=self.sinks, softcap=self.softcap, k_scale=self.k_scale,
                            v_scale=self.v_scale)
        out = self.o_proj(o.view(num_tokens, self.q_size))
        return distributed.get_tp_group().all_reduce(out) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        shard: ModelShard,
        qkv_bias: bool,
        qk_norm: bool,
        sliding_window: int | None,
        mlp: nn.Module | None = None,
        attn: nn.Module | None = None,
    ) -> None:
        super().__init__()
        # ``attn``: another attention (DeepSeek's MLA), called as the GQA ``Attention`` is.
        self.self_attn = (attn if attn is not None
                          else Attention(config, shard, qkv_bias, qk_norm, sliding_window))
        # ``mlp``: a feed-forward other than the dense SwiGLU (a MoE block, which
        # all-reduces its own output under TP); ``[num_tokens, hidden]`` in and out.
        self.mlp = mlp if mlp is not None else MLP(config, shard)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCacheViews,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (HF's ``model.*`` prefix), of this
    rank's shard: the embedding on the first pipeline stage only, the norm on the
    last; ``layers`` has an entry per layer of the full model, a ``PPMissingLayer``
    for those another stage runs. ``make_layer`` / ``norm_cls``: a family's own decoder
    layer ``i`` and norm class in place of ``DecoderLayer`` and ``RMSNorm`` (Gemma)."""

    def __init__(
        self,
        config: Any,
        shard: ModelShard,
        qkv_bias: bool,
        qk_norm: bool,
        windows: list[int | None],
        make_mlp: Callable[[int], nn.Module | None] | None = None,
        make_layer: Callable[[int], nn.Module] | None = None,
        norm_cls: type[RMSNorm] = RMSNorm,
    ):
        super().__init__()
        self.embed_tokens = (
            VocabParallelEmbedding(shard, config.hidden_size) if shard.is_first_stage else None
        )
        self.layers = nn.ModuleList(
            (make_layer(i) if make_layer is not None else DecoderLayer(
                config, shard, qkv_bias, qk_norm, windows[i],
                make_mlp(i) if make_mlp is not None else None))
            if i in shard.layers
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = (
            norm_cls(config.hidden_size, config.rms_norm_eps) if shard.is_last_stage else None
        )
        self._local = shard.layers

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """This stage's layers as a typed list (in order). ``nn.ModuleList`` is not
        generic: it types its items as ``nn.Module``, while every item in the stage's
        range is the ``DecoderLayer`` built in ``__init__``; hence the cast."""
        return cast("list[DecoderLayer]", [self.layers[i] for i in self._local])


class LlamaForCausalLM(nn.Module):
    """Our Llama causal LM.

    Construct with ``build_model`` (``engine/models/registry.py``), which skips
    random initialisation and loads HF weights.

    Built for this process's rank (``ModelShard.current``: the whole model unless
    ``engine/distributed.py`` was initialised with more than one rank).

    Args:
        config: a transformers config (``LlamaConfig`` or compatible).
        max_position: length of the rotary table in tokens (``max_model_len``).
        dtype / device: of the rotary tables (weights follow the module's own).

    Attributes:
        shard: the ``ModelShard`` this instance holds.

    Raises:
        ValueError: a parallel layout the config does not split into (naming
            ``tensor_parallel_size`` or ``pipeline_parallel_size``; see ``ModelShard.of``).
    """

    qkv_bias = False
    qk_norm = False
    #: whether the checkpoint stores q/k/v and gate/up fused (Phi-3) or apart (Llama)
    fused_in_checkpoint = False
    #: served with several ranks (engine/models/support.py; tests/e2e/test_llm_parallel.py)
    supports_tensor_parallel = True
    supports_pipeline_parallel = True

    def __init__(
        self,
        config: Any,
        max_position: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.shard = shard = ModelShard.current(config)
        self.model = self.build_decoder(config, shard)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A tied head reads the embedding, unless the embedding lives on another
        # pipeline stage: then the last stage holds its own copy of the matrix.
        own_head = shard.is_last_stage and not (self.tie_word_embeddings and shard.is_first_stage)
        self.lm_head = (
            nn.Linear(config.hidden_size, shard.vocab_per_rank, bias=False) if own_head else None
        )
        self.tied_lm_head: nn.Module | None = None
        # Decode-only steps through one native call where the CPU and layers allow
        # (kernels/fused_decode.py); built on first use per KV cache. Not with several
        # ranks: under TP each layer needs two all-reduces between the kernel's ops,
        # and a later pipeline stage enters with a residual stream the kernel does not
        # take (it starts from the embeddings).
        self.fused_decode_enabled = shard.tp_size == 1 and shard.pp_size == 1
        self._fused = FusedDecodePath()
        self.rotary = self.make_rotary(config, max_position, dtype, device)

    def build_decoder(self, config: Any, shard: ModelShard) -> DecoderModel:
        """This rank's ``DecoderModel`` (a hook: Gemma builds its own layers and norms)."""
        return DecoderModel(config, shard, self.qkv_bias, self.qk_norm,
                            self.sliding_windows(config), lambda i: self.make_mlp(config, shard, i))

    def make_mlp(self, config: Any, shard: ModelShard, layer: int) -> nn.Module | None:
        """Layer ``layer``'s feed-forward module, or ``None`` for the dense SwiGLU ``MLP``
        (a hook: the MoE families return their sparse block). Called during ``__init__``,
        before the subclass's own attributes are set: reads ``config`` and ``shard`` only."""
        return None

    @staticmethod
    def make_rotary(
        config: Any, max_position: int, dtype: torch.dtype, device: torch.device | str
    ) -> RotaryEmbedding:
        """The rotary tables for ``max_position`` tokens (a hook for RoPE variants that
        ``kernels/rotary.py`` does not compute, e.g. gpt-oss's YaRN)."""
        theta, scaling = rope_params(config)
        return RotaryEmbedding(
            head_dim_of(config), max_position, theta, scaling, dtype=dtype, device=device
        )

    @property
    def max_position(self) -> int:
        """Positions (tokens) the rotary tables cover."""
        return int(self.rotary.max_position)

    def ensure_max_position(self, max_position: int) -> None:
        """Rebuild the rotary tables for ``max_position`` tokens (same dtype/device) when
        they cover fewer."""
        if max_position <= self.rotary.max_position:
            return
        old = self.rotary
        self.rotary = self.make_rotary(self.config, max_position, old.cos.dtype, old.cos.device)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        """Per-layer sliding window (tokens) or ``None`` for full attention."""
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types:
            return [window if t == "sliding_attention" else None for t in layer_types]
        return [None] * config.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheViews],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Run this stage's decoder layers over the step's flattened tokens.

        Args:
            input_ids: ``[num_tokens]`` int64 (read by the first pipeline stage only).
            positions: ``[num_tokens]`` int64 absolute positions.
            kv_caches: per layer of this stage ``(k_cache, v_cache)`` views, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` (this rank's KV
                heads); the new tokens' K/V are written into them.
            attn_metadata: the step's ``AttentionMetadata``.
            intermediate: what the previous stage returned (every stage but the first).

        Returns:
            On the last stage ``[num_tokens, hidden_size]`` final-norm hidden states
            (model dtype); on the others the ``IntermediateTensors`` for the next stage.

        Raises:
            ValueError: a later stage called without ``intermediate``.
        """
        cos_sin = self.rotary.cos_sin(positions)
        embed = self.model.embed_tokens
        hidden, residual = stage_start(embed(input_ids) if embed is not None else None,
                                       intermediate)
        fused = None
        if self.fused_decode_enabled and FusedDecode.serves(attn_metadata):
            # NOTE: per-head q/k norms (Qwen3) sit between the kernel's ops.
            # cast: layers whose ``mlp`` is not the dense MLP (MoE) turn the path off.
            fused = None if self.qk_norm else self._fused.get(
                cast("list[FusedLayer]", self.model.decoder_layers), kv_caches, hidden)
        if fused is not None:
            hidden, residual = fused(hidden, *cos_sin, attn_metadata)
        else:
            for layer, kv_cache in zip(self.model.decoder_layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, cos_sin, kv_cache, attn_metadata)
        return stage_end(self.model.norm, hidden, residual)

    def _head(self) -> nn.Module | None:
        """The LM head module: ``lm_head``, else the packed tied head, else ``None``
        (the embedding matrix serves through ``F.linear``)."""
        return self.lm_head if self.lm_head is not None else self.tied_lm_head

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """``[num_seqs, hidden]`` -> ``[num_seqs, vocab_size]`` logits: float32, or
        the head's own dtype with ``upcast=False`` (the sampler widens them only
        where a processor or logprobs need float32). Last pipeline stage only.

        The head is ``lm_head`` (which ``pack_linear_layers`` may have replaced by
        a ``PackedLinear``), else ``tied_lm_head`` (a packed view of the
        embedding, see ``pack_tied_lm_head``), else the embedding matrix itself.
        Under TP each rank computes its vocabulary shard's logits and TP rank 0
        gathers them (a collective: every TP rank calls this); the other ranks get
        ``None``. With one TP rank never ``None``.
        """
        head = self._head()
        if head is not None:
            logits = head(hidden)
        else:
            embed = self.model.embed_tokens
            assert embed is not None, "a tied head without its own copy sits on the first stage"
            logits = F.linear(hidden, embed.weight)
        if self.shard.tp_size > 1:
            gathered = distributed.get_tp_group().gather(logits, dim=-1)
            if gathered is None:
                return None
            logits = gathered[..., : self.shard.vocab_size]
            if self.shard.vocab_per_rank * self.shard.tp_size != self.shard.vocab_size:
                logits = logits.contiguous()  # the padding columns cut off
        return logits.float() if upcast else logits

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Greedy next tokens straight from ``[num_seqs, hidden]`` states:
        ``[num_seqs]`` int64, the argmax of ``compute_logits(hidden, upcast=False)``
        (first maximal index), computed by the packed head without writing the
        logits; ``None`` where the head has no such path (the caller then computes
        logits and samples), and always under TP (a rank holds a vocabulary shard
        only: the gathered logits serve)."""
        if self.shard.tp_size > 1:
            return None
        forward_argmax = getattr(self._head(), "forward_argmax", None)
        return forward_argmax(hidden) if forward_argmax is not None else None

    def pack_tied_lm_head(self, batch_invariant: bool = False) -> bool:
        """Give a tied LM head its own ``PackedLinear`` or ``Float32ComputeLinear``
        (bf16 CPU only; see ``tandem.kernels.linear``; ``batch_invariant``: see
        ``PackedLinear``).

        The embedding is an ``nn.Embedding``, so ``pack_linear_layers`` never sees
        the head; the packed copies cost one more embedding matrix of memory per
        packing. Returns whether a head was packed.
        """
        if self.model.embed_tokens is None or self.lm_head is not None:
            return False
        if self.tied_lm_head is None:
            self.tied_lm_head = packed_tied_head(self.model.embed_tokens.weight, batch_invariant)
            return self.tied_lm_head is not None
        return False

    # HF name suffix -> (our fused parameter suffix, shard index)
    _stacked = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def _shard_offsets(self, fused: str) -> list[int]:
        """Row offsets of the stacked parts (q, k, v or gate, up) of a fused projection
        held here."""
        shard = self.shard
        if fused == "qkv_proj":
            d = shard.head_dim
            q, kv = shard.num_heads * d, len(shard.kv_heads) * d
            return [0, q, q + kv, q + 2 * kv]
        i = shard.intermediate_size
        return [0, i, 2 * i]

    def _load_one(
        self,
        name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
    ) -> None:
        """Copy this rank's part of HF tensor ``name`` into its (fused) parameter and
        record it in ``loaded`` (``param#shard`` for a part of a fused one).

        Raises:
            ValueError: an unexpected name, or a shape mismatch.
        """
        parts = name.split(".")
        target, part = name, None
        if len(parts) >= 2 and parts[-2] in self._stacked:
            fused, part = self._stacked[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        param = params.get(target)
        if param is None or len(parts) < 2:
            raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
        if is_quant_param(param):  # a quantized layer's packed tensor (engine/quantization)
            offsets = None if part is None else self._shard_offsets(target.split(".")[-2])
            load_quant_part(param, part or 0, offsets,
                            self.shard.shard_hf_tensor(parts[-2], parts[-1], tensor), name)
            loaded.add(target if part is None else f"{target}#{part}")
            return
        dst: torch.Tensor = param
        if part is not None:
            offsets = self._shard_offsets(target.split(".")[-2])
            dst = param[offsets[part] : offsets[part + 1]]
        full = tuple(tensor.shape)
        tensor = self.shard.shard_hf_tensor(parts[-2], parts[-1], tensor)
        if dst.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {full}, expected {tuple(dst.shape)}"
                             + (f" on this rank (of {self.shard})" if full != tensor.shape else ""))
        dst.copy_(tensor)
        loaded.add(target if part is None else f"{target}#{part}")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face state dict into our (fused) parameters: this rank's
        part of each tensor (``ModelShard.shard_hf_tensor``); weights of layers another
        pipeline stage holds are skipped.

        Args:
            weights: ``(hf_name, tensor)`` pairs, e.g. ``model.layers.0.self_attn.q_proj.weight``.
                Tensors are cast to each parameter's dtype and device.

        Raises:
            ValueError: on an unexpected name, a shape mismatch, or parameters
                left unloaded (names them).
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        # A tied head on a later pipeline stage than the embedding: its own copy.
        own_tied_head = self.tie_word_embeddings and self.lm_head is not None
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and (self.lm_head is None or own_tied_head):
                continue  # tied: the embedding is the head (or its copy, below)
            if own_tied_head and name == "model.embed_tokens.weight":
                self._load_one("lm_head.weight", tensor, params, loaded)
            if self.shard.holds_hf_weight(name):
                self._load_one(name, tensor, params, loaded)
        # A missing part of a fused projection is named as the checkpoint names it.
        parts = {(fused, i): hf for hf, (fused, i) in self._stacked.items()}
        missing = []
        for pname in params:
            prefix, _, leaf = pname.rpartition(".")
            layer, _, fused = prefix.rpartition(".")
            n = {"qkv_proj": 3, "gate_up_proj": 2}.get(fused, 0)
            lost = [s for s in range(n) if f"{pname}#{s}" not in loaded]
            if n and not self.fused_in_checkpoint:
                missing += [f"{layer}.{parts[(fused, s)]}.{leaf}" for s in lost]
            elif (n and lost) or (not n and pname not in loaded):
                missing.append(pname)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}")
