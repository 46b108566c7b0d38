"""Multi-head latent attention (MLA) over tandem's paged latent cache.

DeepSeek-V2 (DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model", section 2.1) compresses each token's keys and values
into one latent ``c_kv = RMSNorm(W_DKV h)`` of ``kv_lora_rank`` elements, plus one rotary
key ``k_pe`` of ``qk_rope_head_dim`` shared by every head. The cache holds exactly that
per token and layer (``KVCacheSpec.mla``: the entry ``[c_kv | k_pe]``), not the expanded
per-head K and V.

Attention absorbs the up-projections (section 2.1.3, "we can absorb W_UK into W_Q, and W_UV
into W_O"): with ``kv_b_proj``'s weight split per head into ``W_UK [nope, rank]`` and
``W_UV [v, rank]``,

    q_nope . (W_UK c_kv) = (W_UK^T q_nope) . c_kv      (the query moves into latent space)
    sum_s p_s (W_UV c_kv_s) = W_UV (sum_s p_s c_kv_s)  (the output leaves it after attention)

so every head attends over the same single-"head" entries: multi-query attention with the
query ``[W_UK^T q_nope | q_pe]`` against keys ``[c_kv | k_pe]`` and values ``c_kv`` (the
entry's first ``kv_lora_rank`` elements), which ``kernels.attention.paged_attention`` runs
as one KV head of ``kv_lora_rank + qk_rope_head_dim``. vLLM's MLA backend
(``vllm/attention/backends/mla``) decodes the same way; it expands K/V for long prefills,
which costs less there and gives the same result (here every step is absorbed).

Rotary: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3), ...``; transformers'
DeepSeek-V3 (``apply_rotary_pos_emb_interleave``) writes the rotated pairs de-interleaved
(evens then odds), DeepSeek-V2 (complex multiplication) interleaved. Both give the same
``q_pe . k_pe``, so one form (V3's) serves both; ``rope_interleave=False`` (a V3 option)
takes the ``rotate_half`` form. YaRN (Peng et al. 2023) scales the frequencies and
multiplies cos/sin by its ``attention_factor``; DeepSeek also scales the softmax by
``mscale(factor, mscale_all_dim) ** 2`` (transformers' ``yarn_apply_mscale``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.engine.model_facts import rope_params
from tandem.engine.models.interface import KVCacheViews
from tandem.engine.models.layers import RMSNorm
from tandem.kernels.attention import AttentionMetadata, paged_attention
from tandem.kernels.cache import reshape_and_cache
from tandem.kernels.rotary import rotary_embedding_ref

#: DeepSeek's low-rank norms (``q_a_layernorm``, ``kv_a_layernorm``) use their class's
#: default epsilon, not ``config.rms_norm_eps`` (transformers' ``DeepseekV3RMSNorm(rank)``).
LATENT_NORM_EPS = 1e-6

#: rope types the MLA rotary tables implement
MLA_ROPE_TYPES = ("default", "yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``; YaRN eq. 21)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_rope_params(config: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq [qk_rope_head_dim // 2] float32, attention_factor)`` of an MLA config, as
    transformers' ``ROPE_INIT_FUNCTIONS`` computes them ("default" and "yarn").

    Raises:
        ValueError: another rope type (named).
    """
    dim = int(config.qk_rope_head_dim)
    theta, scaling = rope_params(config)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim
        return 1.0 / (theta**exponent), 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported for MLA "
                         f"models; supported: {', '.join(MLA_ROPE_TYPES)}")
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def mla_softmax_scale(config: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` under YaRN with ``mscale_all_dim`` (transformers'
    ``yarn_apply_mscale``; DeepSeek's reference ``softmax_scale``)."""
    scale = float(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling = rope_params(config)
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        all_dim = scaling.get("mscale_all_dim", 0)
        if all_dim:
            m = yarn_get_mscale(float(scaling["factor"]), all_dim)
            scale = scale * m * m
    return scale


class MLARotary:
    """cos/sin tables of the rotary part, ``[max_position, qk_rope_head_dim // 2]`` each,
    already multiplied by YaRN's ``attention_factor`` (as transformers' cos/sin).

    Args:
        config: the DeepSeek config; max_position: table length in tokens; dtype / device:
            of the tables (computed in float32 first, as transformers does).

    Raises:
        ValueError: an unsupported rope type (``mla_rope_params``).
    """

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        inv_freq, attention_factor = mla_rope_params(config)
        self.max_position = max_position
        # NOTE: device="cpu": models are built under ``torch.device("meta")`` (registry)
        pos = torch.arange(max_position, dtype=torch.int64, device="cpu").to(torch.float32)
        freqs = torch.outer(pos, inv_freq)
        self.cos = (freqs.cos() * attention_factor).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * attention_factor).to(dtype=dtype, device=device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin``: each ``[num_tokens, 1, qk_rope_head_dim // 2]`` for int64 positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[2i], x[2i+1])`` of ``x [T, H, R]`` by ``cos, sin [T, 1, R/2]``;
    the result de-interleaved (rotated evens, then rotated odds), as transformers'
    ``apply_rotary_pos_emb_interleave``."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LatentUpProjection(nn.Module):
    """``kv_b_proj``: ``weight [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``,
    per head ``W_UK`` then ``W_UV``. Not an ``nn.Linear``: attention reads the weight per
    head (absorbed into the query and output) and never applies it as a layer, so the CPU
    linear packing (``kernels.linear.pack_linear_layers``) must leave it as it is."""

    def __init__(self, num_heads: int, nope: int, v: int, rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank))
        self.num_heads, self.nope, self.v, self.rank = num_heads, nope, v, rank

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [H, nope, rank], W_UV^T [H, rank, v])``: views of the weight."""
        w = self.weight.view(self.num_heads, self.nope + self.v, self.rank)
        return w[:, : self.nope], w[:, self.nope :].transpose(1, 2)


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention over the paged latent cache (one rank).

    Parameters carry the Hugging Face names: ``q_proj`` (``q_lora_rank`` None) or
    ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``; ``kv_a_proj_with_mqa`` (``[c_kv |
    k_pe]``), ``kv_a_layernorm``, ``kv_b_proj`` (``LatentUpProjection``), ``o_proj``.

    Args:
        config: a DeepSeek-V2/V3 transformers config (``kv_lora_rank``, ``q_lora_rank``,
            ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, ``attention_bias``,
            ``rope_interleave``).
        interleaved: whether the rotary part rotates interleaved pairs (DeepSeek's layout).

    Forward: ``x [T, hidden]``, ``cos_sin`` (``MLARotary.cos_sin``), the layer's latent
    cache views (``kv_cache_layer_views``: both ``[num_blocks, block_size, 1, kv_lora_rank
    + qk_rope_head_dim]``), the step's metadata -> ``[T, hidden]``; the new tokens' entries
    are written into the cache at ``meta.slot_mapping`` first.
    """

    def __init__(self, config: Any, interleaved: bool) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        self.num_heads = h = int(config.num_attention_heads)
        self.rank = int(config.kv_lora_rank)
        self.nope, self.rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_dim = int(config.v_head_dim)
        self.q_lora_rank = config.q_lora_rank
        self.interleaved = interleaved
        bias = bool(getattr(config, "attention_bias", False))
        qk = self.nope + self.rope
        if self.q_lora_rank is None:
            self.q_proj: nn.Module | None = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, int(self.q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(self.q_lora_rank), LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(int(self.q_lora_rank), h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(h, self.nope, self.v_dim, self.rank)
        self.o_proj = nn.Linear(h * self.v_dim, hidden, bias=bias)
        self.scale = mla_softmax_scale(config)
        # An FP8 latent cache's scale (kernels/kv_quant.py), one for the whole entry: 1.0.
        self.k_scale = self.v_scale = 1.0

    def _rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            return rotate_interleaved(q_pe, cos, sin), rotate_interleaved(k_pe, cos, sin)
        return rotary_embedding_ref(q_pe, cos, sin), rotary_embedding_ref(k_pe, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCacheViews,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], -1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        q_pe, k_pe = self._rotate(q_pe, k_pe.unsqueeze(1), *cos_sin)
        entry = torch.cat((c_kv.unsqueeze(1), k_pe), dim=-1)  # [T, 1, rank + rope]
        # One component: the same view twice (kv_cache_layer_views), the entry written once
        # per call of the kernel (each view write lands on the same bytes).
        reshape_and_cache(entry, entry, kv_cache, meta.slot_mapping,
                          (meta.block_idx, meta.block_offset), self.k_scale, self.k_scale)
        w_uk, w_uv_t = self.kv_b_proj.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent, q_pe), dim=-1)
        out = paged_attention(query, entry, entry, kv_cache, meta, self.scale,
                              k_scale=self.k_scale, v_scale=self.k_scale)
        # values are the entries' latent part; the rotary columns of the output are dropped
        o = torch.bmm(out[..., : self.rank].transpose(0, 1), w_uv_t)  # [H, T, v]
        return self.o_proj(o.transpose(0, 1).reshape(t, h * self.v_dim))
