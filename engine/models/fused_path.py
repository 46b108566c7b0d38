"""The one-call CPU decode path (``kernels/fused_decode.py``) for any model whose decoder
layers have the pre-norm RMSNorm -> fused QKV attention -> RMSNorm -> fused SwiGLU shape.

A model asks ``FusedDecodePath.get`` on each decode-only step; this decides whether the
kernel serves (bf16 on a CPU with AVX512-BF16, every linear packed into the VNNI layout
by ``kernels/linear.py``, W8A8 packed by ``Int8Linear``, W4A8 by ``Int4Linear`` or GGUF
blocks packed by ``GGUFLinear``, shapes within the kernel) and
keeps the built kernel with the KV cache views it was built for. Models only describe their layers (``FusedLayer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from tandem.engine.models.interface import KVCacheViews
from tandem.kernels.fused_decode import (
    DecodeLayerParams,
    FusedDecode,
    GGUFLinearParams,
    Int4LinearParams,
    Int8LinearParams,
    LinearParams,
)

__all__ = [
    "FusedDecodePath", "FusedLayer", "gguf_weight", "int4_weight", "int8_weight", "packed_weight"
]


class _Norm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def eps(self) -> float: ...


class _Attention(Protocol):
    @property
    def qkv_proj(self) -> nn.Module: ...
    @property
    def o_proj(self) -> nn.Module: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def sliding_window(self) -> int | None: ...


class _MLP(Protocol):
    @property
    def gate_up_proj(self) -> nn.Module: ...
    @property
    def down_proj(self) -> nn.Module: ...
    @property
    def intermediate_size(self) -> int: ...


class FusedLayer(Protocol):
    """What the kernel reads of a decoder layer (read-only attributes)."""

    @property
    def input_layernorm(self) -> _Norm: ...
    @property
    def post_attention_layernorm(self) -> _Norm: ...
    @property
    def self_attn(self) -> _Attention: ...
    @property
    def mlp(self) -> _MLP: ...


def packed_weight(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(vnni_weight, bias)`` of a linear that ``kernels/linear.py`` packed into the
    VNNI layout, else ``None`` (an ``nn.Linear``, or a packed one whose shape or CPU
    kept no VNNI weight). ``PackedLinear`` holds both as buffers, which ``nn.Module``
    types as ``Tensor | Module``; hence the narrowing here."""
    weight = getattr(linear, "vnni_weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    bias = getattr(linear, "bias", None)
    assert bias is None or isinstance(bias, torch.Tensor), "a linear's bias is a tensor or None"
    return weight, bias


def int8_weight(linear: nn.Module) -> Int8LinearParams | None:
    """The packed W8A8 weight of an ``Int8Linear`` that holds the native kernel's packing
    (``wp``, ``wsum``, ``scale`` buffers), else ``None``; the bias widened to float32."""
    wp, wsum, scale = (getattr(linear, name, None) for name in ("wp", "wsum", "scale"))
    if not (isinstance(wp, torch.Tensor) and isinstance(wsum, torch.Tensor)
            and isinstance(scale, torch.Tensor)):
        return None
    bias = getattr(linear, "bias", None)
    assert bias is None or isinstance(bias, torch.Tensor), "a linear's bias is a tensor or None"
    return Int8LinearParams(wp, wsum, scale, None if bias is None else bias.float().contiguous())


def int4_weight(linear: nn.Module) -> Int4LinearParams | None:
    """The packed W4A8 weight of an ``Int4Linear`` that holds the native kernel's packing
    (``wp``, ``ws`` buffers and its ``group_size``), else ``None``; the bias widened to
    float32."""
    wp, ws = getattr(linear, "wp", None), getattr(linear, "ws", None)
    group_size = getattr(linear, "group_size", None)
    if not (isinstance(wp, torch.Tensor) and isinstance(ws, torch.Tensor)
            and isinstance(group_size, int)):
        return None
    bias = getattr(linear, "bias", None)
    assert bias is None or isinstance(bias, torch.Tensor), "a linear's bias is a tensor or None"
    return Int4LinearParams(wp, ws, group_size, None if bias is None else bias.float().contiguous())


def gguf_weight(linear: nn.Module) -> GGUFLinearParams | None:
    """The packed blocks of a GGUF projection (``GGUFQuantLinear`` whose ``GGUFLinear``
    packed them for the integer-dot kernel), else ``None``; the bias widened to float32."""
    inner = getattr(linear, "inner", None)
    packed = getattr(inner, "packed", None)
    if packed is None or not hasattr(packed, "wp"):
        return None
    bias = getattr(inner, "bias", None)
    assert bias is None or isinstance(bias, torch.Tensor), "a linear's bias is a tensor or None"
    return GGUFLinearParams(packed.type_id, packed.wp,
                            None if bias is None else bias.float().contiguous())


def _fused_linear(linear: nn.Module) -> LinearParams | None:
    return (packed_weight(linear) or int8_weight(linear) or int4_weight(linear)
            or gguf_weight(linear))


def _layer_params(layer: FusedLayer, kv_cache: KVCacheViews) -> DecodeLayerParams | None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = (
        _fused_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    )
    if qkv is None or o is None or gate_up is None or down is None:
        return None
    k_cache, v_cache = kv_cache
    return DecodeLayerParams(
        input_norm=layer.input_layernorm.weight.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        qkv=qkv, o=o, gate_up=gate_up, down=down,
        k_cache=k_cache, v_cache=v_cache, sliding_window=attn.sliding_window,
    )


class FusedDecodePath:
    """The fused decode kernel of one model, built on first use per KV cache list.

    A built kernel holds the cache views (it has their addresses), so it is kept with
    the list it was built for; a refusal is remembered by the list's id only, so it keeps
    no cache alive.
    """

    def __init__(self) -> None:
        self._built: tuple[list[KVCacheViews], FusedDecode] | None = None
        self._refused: int | None = None

    @property
    def built_for(self) -> list[KVCacheViews] | None:
        """The KV cache views the built kernel serves, ``None`` before one is built."""
        return self._built[0] if self._built is not None else None

    def get(
        self,
        layers: Sequence[FusedLayer],
        kv_caches: list[KVCacheViews],
        hidden: torch.Tensor,
    ) -> FusedDecode | None:
        """The kernel for ``layers`` over ``kv_caches``, or ``None`` where it does not
        apply (not a bf16 CPU model, no AVX512-BF16, unpacked linears, shapes outside it).

        Args:
            layers: this stage's decoder layers, in order.
            kv_caches: one ``KVCacheViews`` per layer.
            hidden: ``[num_tokens, hidden_size]`` embeddings (their dtype and device decide).
        """
        if self._built is not None and self._built[0] is kv_caches:
            return self._built[1]
        if self._refused == id(kv_caches):
            return None
        fused = self._build(layers, kv_caches, hidden)
        if fused is None:
            self._refused = id(kv_caches)
        else:
            self._built = (kv_caches, fused)
        return fused

    @staticmethod
    def _build(
        layers: Sequence[FusedLayer], kv_caches: list[KVCacheViews], hidden: torch.Tensor
    ) -> FusedDecode | None:
        if not (hidden.device.type == "cpu" and hidden.dtype == torch.bfloat16
                and FusedDecode.available()):
            return None
        params = []
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            p = _layer_params(layer, kv_cache)
            if p is None:
                return None
            params.append(p)
        if not params:
            return None
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        try:
            return FusedDecode(params, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim,
                               mlp0.intermediate_size, layers[0].input_layernorm.eps,
                               attn0.scale)
        except ValueError:
            return None  # shapes outside the kernel: the per-op path serves
