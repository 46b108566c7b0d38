"""Decode steps of Llama-form transformers models through tandem's one-call CPU kernel.

Even with fused projections (``transformers_fusion.py``), a transformers decoder layer
is five native calls (QKV, attention, o, gate/up, down) and some twenty torch ops, each
a Python dispatch and, for the native ones, an OpenMP fork-join. tandem's native bf16
Llama runs a whole decode step in one call (``kernels/fused_decode.py``); on a small
model that call count is most of the difference between the two.

For model types whose transformers decoder layer computes exactly the layer that
kernel computes (``LLAMA_FORM_MODEL_TYPES``: pre-norm RMSNorm ``weight * x / rms``,
rotary in the ``rotate_half`` layout, attention with ``scaling`` and an optional
sliding window, no q/k norms, SwiGLU MLP, residual adds without multipliers), a bf16
decode-only step on a CPU with AVX512-BF16 runs that kernel over the model's own
(fused, packed) weights: the embedding, the rotary tables (cos/sin of the model's own
rotary module, so every rope scaling it knows holds) and the final norm stay
transformers' modules. Every other step, dtype, CPU or architecture runs transformers'
code; the kernel's numerics are those of tandem's native bf16 path (another rounding
order than transformers' bf16 ops, as the native model's).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from tandem.engine.models.fused_path import FusedDecodePath, FusedLayer
from tandem.engine.models.interface import KVCacheViews
from tandem.kernels.attention import AttentionMetadata
from tandem.kernels.fused_decode import FusedDecode

__all__ = ["LLAMA_FORM_MODEL_TYPES", "TransformersFusedDecode"]

#: model types whose transformers decoder layer is the fused kernel's layer
LLAMA_FORM_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


class _Norm:
    """A transformers RMSNorm as ``fused_path``'s norm (``weight``, ``eps``)."""

    def __init__(self, norm: Any) -> None:
        self._norm = norm

    @property
    def weight(self) -> torch.Tensor:
        return self._norm.weight

    @property
    def eps(self) -> float:
        return float(self._norm.variance_epsilon)


class _Attention:
    """A transformers attention module with fused q/k/v as ``fused_path``'s attention;
    the projections are read when the kernel is built (after the runner packed them)."""

    def __init__(self, attn: Any, num_heads: int, num_kv_heads: int,
                 window: int | None) -> None:
        self._attn = attn
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = int(attn.head_dim)
        self.scale = float(attn.scaling)
        self.sliding_window = window

    @property
    def qkv_proj(self) -> nn.Module:
        return self._attn.fused_q_k_v.linear

    @property
    def o_proj(self) -> nn.Module:
        return self._attn.o_proj


class _MLP:
    """A transformers gated MLP with fused gate/up as ``fused_path``'s MLP."""

    def __init__(self, mlp: Any) -> None:
        self._mlp = mlp
        self.intermediate_size = int(mlp.down_proj.in_features)

    @property
    def gate_up_proj(self) -> nn.Module:
        return self._mlp.fused_gate_up.linear

    @property
    def down_proj(self) -> nn.Module:
        return self._mlp.down_proj


class _Layer:
    def __init__(self, layer: Any, num_heads: int, num_kv_heads: int,
                 window: int | None) -> None:
        self.input_layernorm = _Norm(layer.input_layernorm)
        self.post_attention_layernorm = _Norm(layer.post_attention_layernorm)
        self.self_attn = _Attention(layer.self_attn, num_heads, num_kv_heads, window)
        self.mlp = _MLP(layer.mlp)


def _llama_form(config: Any, base: Any) -> bool:
    """Whether ``base``'s layers are the kernel's (see the module docstring): the model
    type, SiLU, and every layer's fused q/k/v and gate/up groups in place."""
    if getattr(config, "model_type", None) not in LLAMA_FORM_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", None) != "silu":
        return False
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not (hasattr(attn, "fused_q_k_v") and hasattr(mlp, "fused_gate_up")
                and hasattr(layer, "input_layernorm")
                and hasattr(layer, "post_attention_layernorm")):
            return False
    return all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm"))


class TransformersFusedDecode:
    """Runs a Llama-form transformers model's decode-only steps in one kernel call.

    Args:
        config: the model's transformers config; base: its base model (``.model``),
            projections already fused by ``transformers_fusion``.
        num_heads / num_kv_heads: per layer (the probed KV geometry).
        windows: per layer sliding window (tokens) or ``None``.

    Use ``for_model`` (``None`` where the model is not of the kernel's form).
    """

    def __init__(self, config: Any, base: Any, num_heads: int, num_kv_heads: int,
                 windows: list[int | None]) -> None:
        self._base: Any = base
        self._layers = [_Layer(layer, num_heads, num_kv_heads, w)
                        for layer, w in zip(base.layers, windows, strict=True)]
        self._half = self._layers[0].self_attn.head_dim // 2
        self._path = FusedDecodePath()

    @classmethod
    def for_model(cls, config: Any, base: Any, num_heads: int, num_kv_heads: int,
                  windows: list[int | None], dtype: torch.dtype,
                  device: torch.device) -> TransformersFusedDecode | None:
        """The runner for a bf16 CPU Llama-form model whose CPU runs the kernel, else
        ``None``."""
        if dtype != torch.bfloat16 or device.type != "cpu" or not FusedDecode.available():
            return None
        if not _llama_form(config, base):
            return None
        return cls(config, base, num_heads, num_kv_heads, windows)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCacheViews], meta: AttentionMetadata) -> torch.Tensor | None:
        """``[T, hidden]`` final-norm hidden states (bf16) of a decode-only step, the new
        K/V written into ``kv_caches``; ``None`` (nothing run) where the kernel does not
        serve this step (a prefill, too many tokens, unpacked linears, shapes outside
        its tiling)."""
        if not FusedDecode.serves(meta):
            return None
        base = self._base
        hidden = base.embed_tokens(input_ids)
        fused = self._path.get(cast("list[FusedLayer]", self._layers), kv_caches, hidden)
        if fused is None:
            return None
        # transformers' tables are ``cat(freqs, freqs)``: the kernel takes one half
        cos, sin = base.rotary_emb(hidden[None], positions[None])
        cos = cos[0, :, : self._half].unsqueeze(1).to(hidden.dtype)
        sin = sin[0, :, : self._half].unsqueeze(1).to(hidden.dtype)
        out, residual = fused(hidden, cos, sin, meta)
        return base.norm(out + residual)
