"""tandem's paged attention as a transformers attention implementation.

transformers' modeling code computes each layer's query, key and value itself (its own
projections, norms and rotary embedding) and hands them to the function registered under
``config._attn_implementation`` in its public ``AttentionInterface``; the model builds no
dense mask for a name that ``AttentionMaskInterface`` does not know. Registering
``tandem_paged`` there is how vLLM's Transformers modeling backend (``--model-impl
transformers``) and the transformers guide "Building a compatible model backend for
inference" plug an engine's attention into any model: this module does the same with
tandem's block-table KV cache (``kernels/cache.py``) and ``paged_attention``
(``kernels/attention.py``).

The engine calls the model with batch size 1 over the step's flattened tokens; the
step's ``AttentionMetadata`` holds each sequence's causal structure, and ``StepContext``
carries it, with the per-layer KV cache views, to the attention function: through the
forward kwargs, which transformers routes to the attention function, and through a
context variable for models whose code does not route them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models.interface import KVCacheViews
from tandem.kernels.attention import AttentionMetadata, build_attention_metadata, paged_attention
from tandem.kernels.cache import reshape_and_cache

#: the ``attn_implementation`` name tandem registers with transformers
ATTN_IMPLEMENTATION = "tandem_paged"

#: the forward kwarg that carries the ``StepContext`` to the attention function
STEP_KWARG = "tandem_step"


@dataclass(frozen=True)
class LayerGeometry:
    """What one attention layer puts into the KV cache, as the probe saw it.

    Attributes:
        num_heads: query heads; num_kv_heads: K/V heads (after any expansion the
            modeling code does, e.g. MLA's up-projection).
        k_head_dim / v_head_dim: elements of one K / V head (they differ for MLA).
    """

    num_heads: int
    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int

    @property
    def head_dim(self) -> int:
        """The cache's head size: the larger of K's and V's (the other zero-padded)."""
        return max(self.k_head_dim, self.v_head_dim)


@dataclass
class StepContext:
    """One forward's attention inputs, shared by every layer.

    Attributes:
        meta: the step's ``AttentionMetadata``.
        kv_caches: per layer ``KVCacheViews``; ``None`` in a probe, which allocates a
            small cache per layer on first use (``probe_caches``).
        windows: per layer the sliding window the config declares (``None``: full),
            used when the modeling code passes none.
        layer_of: ``id(module) -> layer index`` for attention modules without a
            ``layer_idx`` (filled in call order by the probe).
        geometry: per layer index, the ``LayerGeometry`` seen (filled by a probe).
    """

    meta: AttentionMetadata
    kv_caches: list[KVCacheViews] | None
    windows: list[int | None]
    layer_of: dict[int, int]
    geometry: dict[int, LayerGeometry] = field(default_factory=dict)
    probe_caches: dict[int, KVCacheViews] = field(default_factory=dict)
    calls: int = 0


_STEP: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "tandem_step", default=None
)


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Make ``ctx`` the current step for models whose code drops the forward kwargs."""
    token = _STEP.set(ctx)
    try:
        yield ctx
    finally:
        _STEP.reset(token)


def probe_context(num_tokens: int, device: torch.device, windows: list[int | None],
                  layer_of: dict[int, int]) -> StepContext:
    """A ``StepContext`` for one fresh sequence of ``num_tokens`` tokens with its own
    small caches (allocated per layer at first use): for the load-time probe."""
    meta = build_attention_metadata([num_tokens], [0], [[0]], num_tokens, device)
    return StepContext(meta=meta, kv_caches=None, windows=windows, layer_of=layer_of)


def _layer_index(ctx: StepContext, module: nn.Module) -> int:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx
    known = ctx.layer_of.get(id(module))
    if known is not None:
        return known
    if ctx.kv_caches is not None:
        raise RuntimeError(f"attention module {type(module).__name__} has no layer_idx and "
                           "was not seen by the load-time probe")
    ctx.layer_of[id(module)] = len(ctx.layer_of)
    return ctx.layer_of[id(module)]


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    return t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1]))


def tandem_paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``tandem_paged`` attention function (transformers' ``AttentionInterface``
    signature): write the step's K/V into the layer's paged cache, attend over it.

    Args:
        module: the calling attention module; its ``layer_idx`` picks the cache.
        query: ``[1, num_heads, T, dk]``; key: ``[1, num_kv_heads, T, dk]``; value:
            ``[1, num_kv_heads, T, dv]``, over the step's ``T`` flattened tokens (after
            the model's rotary embedding).
        attention_mask: ignored: the step's metadata holds each sequence's causal
            structure (no dense mask is built for this implementation).
        scaling: softmax scale (``dk ** -0.5`` when ``None``).
        kwargs: ``sliding_window`` (else the config's for this layer), ``softcap``
            (Gemma 2's attention logit softcapping), ``s_aux`` (gpt-oss's per-head
            sink logits) and ``tandem_step`` (the ``StepContext``; else the current one).

    Returns:
        ``([1, T, num_heads, dv], None)`` in the query's dtype (no attention weights).

    Raises:
        RuntimeError: outside a tandem forward, or on a module no probe has seen.
    """
    ctx = kwargs.get(STEP_KWARG) or _STEP.get()
    if ctx is None:
        raise RuntimeError(f"attn_implementation {ATTN_IMPLEMENTATION!r} runs inside tandem's "
                           "forward only (no step context)")
    layer = _layer_index(ctx, module)
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else None
    if "sliding_window" not in kwargs and layer < len(ctx.windows):
        window = ctx.windows[layer]
    num_heads, dk = query.shape[1], query.shape[-1]
    num_kv_heads, dv = key.shape[1], value.shape[-1]
    geo = LayerGeometry(num_heads, num_kv_heads, dk, dv)
    d = geo.head_dim
    # [1, heads, T, d] -> [T, heads, d]; a zero-padded K (and Q) leaves the scores
    # unchanged, a zero-padded V adds zero columns that the output drops.
    q = _pad_last(query[0].transpose(0, 1), d)
    k = _pad_last(key[0].transpose(0, 1), d).contiguous()
    v = _pad_last(value[0].transpose(0, 1), d).contiguous()
    if ctx.kv_caches is None:
        ctx.geometry[layer] = geo
        cache = ctx.probe_caches.get(layer)
        if cache is None:
            shape = (1, ctx.meta.block_size, num_kv_heads, d)
            cache = (query.new_zeros(shape), query.new_zeros(shape))
            ctx.probe_caches[layer] = cache
    else:
        cache = ctx.kv_caches[layer]
    ctx.calls += 1
    meta = ctx.meta
    reshape_and_cache(k, v, cache, meta.slot_mapping, (meta.block_idx, meta.block_offset))
    scale = float(scaling) if scaling is not None else dk**-0.5
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    o = paged_attention(q, k, v, cache, meta, scale, window,
                        softcap=float(softcap) if softcap else None,
                        sinks=sinks.to(q.dtype) if sinks is not None else None)
    return o[..., :dv].unsqueeze(0), None


_registered = False


def register() -> None:
    """Register ``tandem_paged`` with transformers' ``AttentionInterface`` (once per
    process). No ``AttentionMaskInterface`` entry: transformers then builds no mask."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, tandem_paged_attention)
        _registered = True
