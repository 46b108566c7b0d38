"""Rotary position embedding (Su et al. 2021, "RoFormer"), GPT-NeoX / HF layout.

The head dimension is split in two halves (``rotate_half`` convention used by
transformers' Llama, Mistral, Qwen2 and Qwen3). Frequencies follow transformers'
``ROPE_INIT_FUNCTIONS``: "default", "linear", "llama3" (Llama 3.1 frequency
smoothing) and "longrope" (Phi-3; Ding et al. 2024, "LongRoPE") are supported; anything
else raises ``ValueError``. A rotary dimension smaller than the head's (partial rotary,
e.g. Phi-4-mini) rotates the leading dimensions and passes the rest through.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tandem.kernels import backend, cpu_ext
from tandem.kernels.backend import KernelBackend

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    rope_scaling = rope_scaling or {}
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def longrope_uses_long_factors(rope_scaling: dict[str, Any], max_position: int) -> bool:
    """Whether LongRoPE tables for ``max_position`` tokens take ``long_factor``: when the
    context exceeds ``original_max_position_embeddings``. transformers switches per forward
    call (by the call's largest position) and re-prefills when a sequence crosses it; a
    server with a paged, shared prefix cache needs one rotation per engine, so the choice
    follows the context length served, as vLLM decides it (vllm-project/vllm#27431)."""
    return max_position > int(rope_scaling["original_max_position_embeddings"])


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by (transformers' ``attention_scaling``): 1.0
    except for LongRoPE, where it is ``attention_factor`` or else
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` for a ``factor``
    above 1 (``factor``: the context extension, ``max_position_embeddings / original``).
    """
    if _rope_type(rope_scaling) != "longrope":
        return 1.0
    assert rope_scaling is not None
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling.get("factor") or 1.0)
    if factor <= 1.0:
        return 1.0
    original = float(rope_scaling["original_max_position_embeddings"])
    return math.sqrt(1 + math.log(factor) / math.log(original))


def compute_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
    max_position: int | None = None,
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 (on CPU).

    Args:
        head_dim: rotary dimension (the head dimension, or its rotated part).
        rope_theta: base of the geometric frequency progression.
        rope_scaling: ``None`` or a dict with ``rope_type`` (or ``type``) among
            SUPPORTED_ROPE_TYPES and that type's parameters (``factor``;
            llama3: ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``; longrope: ``short_factor`` and
            ``long_factor`` (``head_dim // 2`` each), ``original_max_position_embeddings``).
        max_position: the context the tables serve (longrope: picks the factors, see
            ``longrope_uses_long_factors``; ``None``: the short ones).

    Raises:
        ValueError: for an unsupported ``rope_type`` (names it).
    """
    # Same expression as transformers so that float32 results agree bit for bit.
    exponent = (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    )
    inv_freq = 1.0 / (rope_theta**exponent)
    rope_type = _rope_type(rope_scaling)
    rope_scaling = rope_scaling or {}
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling["low_freq_factor"])
        high = float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "longrope":
        long = max_position is not None and longrope_uses_long_factors(rope_scaling, max_position)
        factors = rope_scaling["long_factor" if long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(f"rope_scaling: {len(factors)} LongRoPE factors for rotary "
                             f"dimension {head_dim} (expected {head_dim // 2})")
        ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
        return 1.0 / (ext * rope_theta**exponent)  # transformers' expression, bit for bit
    raise ValueError(
        f"rope_scaling.rope_type {rope_type!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions ``[0, max_position)``.

    Args:
        head_dim: rotary dimension (even): the head dimension, or the rotated leading
            part of it (partial rotary).
        max_position: table length in tokens (the engine's ``max_model_len``).
        rope_theta / rope_scaling: see ``compute_inv_freq``; LongRoPE's attention factor
            (``rope_attention_factor``) scales the tables.
        dtype / device: of the returned cos/sin (the model's dtype), computed in
            float32 first as transformers does.

    Raises:
        ValueError: an odd ``head_dim``; see ``compute_inv_freq``.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling, max_position)
        pos = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_position, head_dim // 2]
        cos, sin = freqs.cos(), freqs.sin()
        attention_factor = rope_attention_factor(rope_scaling)
        if attention_factor != 1.0:  # in float32 before the cast, as transformers scales
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos = cos.to(dtype=dtype, device=device)
        self.sin = sin.to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin``: each ``[num_tokens, 1, head_dim // 2]`` for int64 ``positions``.

        Computed once per forward and shared by every layer.
        """
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [num_tokens, num_heads, head_dim]`` by per-token angles.

    ``cos, sin: [num_tokens, 1, head_dim // 2]`` (same dtype as ``x``). Equals
    transformers' ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotary embedding to ``query: [T, H, D]`` and ``key: [T, KVH, D]``.

    ``cos, sin: [T, 1, R // 2]`` rotate the leading ``R <= D`` dimensions of each head;
    the other ``D - R`` pass through unchanged (partial rotary, as transformers' Phi-3 and
    StableLM apply it). Returns new tensors (the inputs are not modified).

    Raises:
        ValueError: on mismatched token counts, head dims or dtypes.
    """
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError("query and key must be [num_tokens, num_heads, head_dim]")
    if query.shape[0] != key.shape[0] or query.shape[0] != cos.shape[0]:
        raise ValueError(
            f"num_tokens differ: query {query.shape[0]}, key {key.shape[0]}, cos {cos.shape[0]}"
        )
    rot = cos.shape[-1] * 2
    if query.shape[-1] == key.shape[-1] and 0 < rot < query.shape[-1]:
        q_rot, k_rot = rotary_embedding(
            query[..., :rot].contiguous(), key[..., :rot].contiguous(), cos, sin)
        return (torch.cat([q_rot, query[..., rot:]], dim=-1),
                torch.cat([k_rot, key[..., rot:]], dim=-1))
    if query.shape[-1] != key.shape[-1] or rot != query.shape[-1]:
        raise ValueError(
            f"head_dim mismatch: query {query.shape[-1]}, key {key.shape[-1]}, "
            f"cos {cos.shape[-1]} (half)"
        )
    if not (query.dtype == key.dtype == cos.dtype == sin.dtype):
        raise ValueError("query, key, cos and sin must share a dtype")
    if backend.current().for_tensor(query) is KernelBackend.CPU_NATIVE:
        q = cpu_ext.rotary_neox_cpu(query, cos, sin)
        k = cpu_ext.rotary_neox_cpu(key, cos, sin) if q is not None else None
        if q is not None and k is not None:
            return q, k
    return rotary_embedding_ref(query, cos, sin), rotary_embedding_ref(key, cos, sin)
