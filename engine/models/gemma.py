"""Gemma 2 and Gemma 3 (text) decoders written against ``kernels/``.

Architecture as in the Gemma 2 report (Team Gemma 2024, "Gemma 2: Improving Open
Language Models at a Practical Size") and the Gemma 3 report (Team Gemma 2025), and
transformers' ``modeling_gemma2.py`` / ``modeling_gemma3.py``, which are the numerical
reference here:

* embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the model dtype;
* RMSNorm whose weight is an offset from one: ``x_hat * (1 + w)``, multiplied in float32
  before the cast back (Llama casts first, then multiplies by ``w``);
* four norms per layer: before and after attention, before and after the feed-forward;
* a GeGLU feed-forward, ``down(gelu_tanh(gate(x)) * up(x))``;
* sliding-window and global layers alternating (``config.layer_types``);
* scores scaled by ``query_pre_attn_scalar ** -0.5`` rather than ``head_dim ** -0.5``;
* Gemma 2: attention logit softcapping ``s = cap * tanh(s / cap)`` (``attn_logit_softcapping``);
  both: final logit softcapping (``final_logit_softcapping``);
* Gemma 3: per-head (1 + w) RMSNorm on queries and keys before RoPE, and two rotary
  tables: ``rope_local_base_freq`` for sliding layers, ``rope_theta`` (with its scaling)
  for global ones. transformers' Gemma 3 does not apply ``attn_logit_softcapping``.

The layers reuse Llama's fused QKV attention (``engine/models/llama.py``), its weight
loading (HF ``q/k/v`` and ``gate/up`` onto fused parameters) and TP/PP sharding
(``engine/models/sharding.py``). The one-call bf16 CPU decode kernel
(``kernels/fused_decode.py``) computes Llama's layer shape only: these models never take
it (``fused_decode_enabled`` is False) and run the per-op path.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import distributed
from tandem.engine.model_facts import head_dim_of, rope_params
from tandem.engine.models.interface import IntermediateTensors, KVCacheViews
from tandem.engine.models.layers import RMSNorm, stage_end, stage_start
from tandem.engine.models.llama import Attention, DecoderModel, LlamaForCausalLM
from tandem.engine.models.sharding import ModelShard
from tandem.kernels.attention import AttentionMetadata
from tandem.kernels.rotary import RotaryEmbedding

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaRMSNorm"]

SLIDING, FULL = "sliding_attention", "full_attention"
#: ``(cos, sin)``, each ``[num_tokens, 1, rotary_dim // 2]`` in the model dtype
CosSin = tuple[torch.Tensor, torch.Tensor]


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``(x_hat * (1 + weight)).to(x.dtype)`` with ``x_hat`` the float32
    normalised ``x``; the stored weight is the offset from one (HF checkpoints hold it so).

    Forward: ``x [..., hidden]`` (any float dtype; the weight in the same dtype), optional
    ``residual`` shaped like ``x``: then ``x + residual`` (in ``x.dtype``, as transformers
    adds the residual stream) is normalised and returned too, as ``rms_norm`` does.
    """

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # (1 + w) in float32, never rounded to the model dtype: in bf16 a copy of 1 + w made
        # at load would lose the offset's low bits.
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class GeGLUMLP(nn.Module):
    """GeGLU feed-forward (Shazeer 2020): ``down(gelu_tanh(gate(x)) * up(x))`` over this TP
    rank's ``shard.intermediate_size`` slice; ``gate``/``up`` fused into ``gate_up_proj``
    (gate rows first), row-parallel ``down`` then the TP all-reduce.

    Raises:
        ValueError: ``hidden_activation`` other than the tanh-approximated GELU.
    """

    def __init__(self, config: Any, shard: ModelShard) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        self.intermediate_size: int = shard.intermediate_size
        self.tp_size = shard.tp_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return distributed.get_tp_group().all_reduce(out) if self.tp_size > 1 else out


class GemmaDecoderLayer(nn.Module):
    """A Gemma 2/3 decoder layer: norm -> attention -> norm, residual add, norm -> GeGLU ->
    norm, residual add.

    Carries the stream as Llama's layers do (``engine/models/llama.py``): it takes and
    returns ``(hidden, residual)`` with the stream equal to ``hidden + residual``, so the
    add is fused into the next norm and a pipeline stage hands over both tensors.

    Args:
        config / shard: the model's config and this rank's ``ModelShard``.
        layer_type: ``"sliding_attention"`` or ``"full_attention"``.
        qk_norm: per-head (1 + w) RMSNorm on queries and keys (Gemma 3).
        softcap: attention logit softcapping (Gemma 2) or ``None``.
    """

    def __init__(
        self, config: Any, shard: ModelShard, layer_type: str, qk_norm: bool,
        softcap: float | None,
    ) -> None:
        super().__init__()
        window = config.sliding_window if layer_type == SLIDING else None
        self.layer_type = layer_type
        self.self_attn = Attention(config, shard, False, False, window)
        attn = self.self_attn
        attn.scale = float(config.query_pre_attn_scalar) ** -0.5
        attn.softcap = softcap
        if qk_norm:
            attn.q_norm = GemmaRMSNorm(attn.head_dim, config.rms_norm_eps)
            attn.k_norm = GemmaRMSNorm(attn.head_dim, config.rms_norm_eps)
        self.mlp = GeGLUMLP(config, shard)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

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
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos_sin, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``): see the module docstring for what differs from Llama.

    Construct with ``build_model`` (``engine/models/registry.py``). Args, attributes and
    errors as ``LlamaForCausalLM``; also raises ``ValueError`` for an unsupported
    ``hidden_activation`` or a bidirectional config (``use_bidirectional_attention``: an
    embedding model, not a causal LM).
    """

    qk_norm = False
    #: whether the config's ``attn_logit_softcapping`` applies (transformers' Gemma 3 ignores it)
    attn_softcapping = True

    def __init__(
        self,
        config: Any,
        max_position: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention is set (an "
                             "embedding model); only causal language models are served")
        super().__init__(config, max_position, dtype, device)
        # Extra norms and GeGLU between the kernel's ops: the per-op path serves decode.
        self.fused_decode_enabled = False
        self.final_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.embed_scale = math.sqrt(config.hidden_size)

    @staticmethod
    def layer_types(config: Any) -> list[str]:
        """Per-layer ``"sliding_attention"`` / ``"full_attention"``: ``config.layer_types``,
        else Gemma 2's alternation starting with a sliding layer."""
        types = getattr(config, "layer_types", None)
        return list(types) if types else [
            SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)]

    @classmethod
    def sliding_windows(cls, config: Any) -> list[int | None]:
        return [config.sliding_window if t == SLIDING else None for t in cls.layer_types(config)]

    def build_decoder(self, config: Any, shard: ModelShard) -> DecoderModel:
        types = self.layer_types(config)
        cap = getattr(config, "attn_logit_softcapping", None) if self.attn_softcapping else None
        return DecoderModel(
            config, shard, False, False, [None] * config.num_hidden_layers,
            make_layer=lambda i: GemmaDecoderLayer(config, shard, types[i], self.qk_norm, cap),
            norm_cls=GemmaRMSNorm)

    def rotary_tables(self, positions: torch.Tensor) -> dict[str, CosSin]:
        """``layer_type -> (cos, sin)`` at ``positions`` (one table for every layer here)."""
        cos_sin = self.rotary.cos_sin(positions)
        return {SLIDING: cos_sin, FULL: cos_sin}

    @property
    def gemma_layers(self) -> list[GemmaDecoderLayer]:
        """This stage's layers (``DecoderModel.decoder_layers`` types them as Llama's)."""
        return cast("list[GemmaDecoderLayer]", list(self.model.decoder_layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheViews],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """As ``LlamaForCausalLM.forward`` (shapes, dtypes, pipeline stages, errors), with
        the embeddings scaled by ``sqrt(hidden_size)`` in the model dtype (transformers'
        ``Gemma2TextScaledWordEmbedding``: the factor is a float32 tensor cast to the
        weight's dtype, so bf16 multiplies by a rounded factor) and each layer's own
        rotary table."""
        embed = self.model.embed_tokens
        embedded = None
        if embed is not None:
            scale = torch.tensor(self.embed_scale, dtype=torch.float32).to(embed.weight.dtype)
            embedded = embed(input_ids) * scale
        hidden, residual = stage_start(embedded, intermediate)
        tables = self.rotary_tables(positions)
        for layer, kv_cache in zip(self.gemma_layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, tables[layer.layer_type], kv_cache,
                                     attn_metadata)
        return stage_end(self.model.norm, hidden, residual)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """As ``LlamaForCausalLM.compute_logits``, then ``cap * tanh(logits / cap)`` with
        ``final_logit_softcapping`` in the head's dtype (as transformers computes it)
        before the float32 upcast."""
        logits = super().compute_logits(hidden, upcast=False)
        if logits is None:
            return None
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float() if upcast else logits

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``None`` with final softcapping (the caller computes logits): the packed head's
        argmax is over the raw logits, and rounding after the tanh can tie two of them, so
        the first maximal index could differ from the softcapped logits' argmax."""
        return None if self.final_softcap else super().compute_greedy(hidden)


def gemma3_rope(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling | None)`` of Gemma 3's ``layer_type`` layers, from a
    transformers 5 config (``rope_parameters`` per layer type) or a 4.x one
    (``rope_theta`` and ``rope_scaling`` global, ``rope_local_base_freq`` sliding)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        p = params[layer_type]
        kind = p.get("rope_type", p.get("type", "default"))
        return float(p["rope_theta"]), (dict(p) if kind != "default" else None)
    if layer_type == SLIDING:
        return float(getattr(config, "rope_local_base_freq", 10000.0)), None
    return rope_params(config)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3, text only (``Gemma3ForCausalLM`` with a ``gemma3_text`` config): Gemma 2's
    layout plus q/k norms and a second rotary table for the sliding layers; no attention
    logit softcapping. Errors as ``Gemma2ForCausalLM``."""

    qk_norm = True
    attn_softcapping = False

    def __init__(
        self,
        config: Any,
        max_position: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(config, max_position, dtype, device)
        self.local_rotary = self._rotary(config, SLIDING, max_position, dtype, device)

    @staticmethod
    def _rotary(config: Any, layer_type: str, max_position: int, dtype: torch.dtype,
                device: torch.device | str) -> RotaryEmbedding:
        theta, scaling = gemma3_rope(config, layer_type)
        return RotaryEmbedding(head_dim_of(config), max_position, theta, scaling, dtype=dtype,
                               device=device)

    @staticmethod
    def layer_types(config: Any) -> list[str]:
        """``config.layer_types``, else every ``sliding_window_pattern``-th layer global."""
        types = getattr(config, "layer_types", None)
        pattern = int(getattr(config, "sliding_window_pattern", 6) or 6)
        return list(types) if types else [
            FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]

    @staticmethod
    def make_rotary(
        config: Any, max_position: int, dtype: torch.dtype, device: torch.device | str
    ) -> RotaryEmbedding:
        """The global layers' table (``rope_theta`` with its scaling)."""
        return Gemma3ForCausalLM._rotary(config, FULL, max_position, dtype, device)

    def ensure_max_position(self, max_position: int) -> None:
        """Grow both rotary tables to ``max_position`` tokens when they cover fewer."""
        if max_position <= self.max_position:
            return
        super().ensure_max_position(max_position)
        old = self.local_rotary
        self.local_rotary = self._rotary(self.config, SLIDING, max_position, old.cos.dtype,
                                         old.cos.device)

    def rotary_tables(self, positions: torch.Tensor) -> dict[str, CosSin]:
        return {SLIDING: self.local_rotary.cos_sin(positions), FULL: self.rotary.cos_sin(positions)}
