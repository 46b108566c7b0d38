"""A checkpoint's calibrated KV cache scales, taken out of its weights into the attention
layers that an FP8 KV cache (``kernels/kv_quant.py``) quantizes with.

FP8 checkpoints made by llm-compressor / compressed-tensors (``kv_cache_scheme``), NVIDIA
ModelOpt and AutoFP8 carry one per-tensor scale per layer for K and one for V, as vLLM
reads them: ``<layer>.self_attn.k_scale`` / ``v_scale``, the older
``<layer>.self_attn.k_proj.output_scale`` / ``v_proj.output_scale``, or one
``<layer>.self_attn.kv_scale`` for both. A cached value is ``x / scale`` rounded to FP8, so a
scale calibrated to the layer's largest |K| keeps large keys from clamping at FP8's maximum
(448 for e4m3) where the default 1.0 would.

The scales are used only by an FP8 cache; a cache in the model's dtype stores K and V as
they are and the scales change nothing. The identity of the scales in use goes into the
KV layout's fingerprint (``kernels.kv_quant.scales_id``), so blocks written with other
scales are a miss in the store, never misread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

#: checkpoint name suffix -> which of the layer's scales it sets ("k", "v" or both)
_SUFFIXES: tuple[tuple[str, str], ...] = (
    (".k_proj.output_scale", "k"),
    (".v_proj.output_scale", "v"),
    (".k_scale", "k"),
    (".v_scale", "v"),
    (".kv_scale", "kv"),
)


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """``(attention module name, "k" | "v" | "kv")`` for a checkpoint tensor that is a KV
    cache scale, else ``None``.

    >>> kv_scale_target("model.layers.3.self_attn.k_scale")
    ('model.layers.3.self_attn', 'k')
    """
    for suffix, which in _SUFFIXES:
        if name.endswith(suffix) and ".self_attn" in name:
            return name[: -len(suffix)], which
    return None


def _scalar(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV cache scale must be one value per tensor (per-tensor "
                         f"FP8 scales), got shape {list(tensor.shape)}")
    value = float(tensor.reshape(()).float())
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name}: a KV cache scale must be finite and > 0, got {value}")
    return value


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without its KV cache scales, each of which is set on ``model``'s
    attention module of that name (its ``k_scale`` / ``v_scale`` float attributes).

    Args:
        model: the model being loaded; its attention modules that take an FP8 cache's
            scales have ``k_scale`` and ``v_scale`` attributes.
        weights: ``(hf_name, tensor)`` pairs of the checkpoint.

    Yields:
        The other ``(hf_name, tensor)`` pairs, in order.

    A scale of a layer that another pipeline stage holds is skipped. A scale for an
    attention module that takes none (an implementation without FP8 KV scales, e.g. the
    Transformers backend) is recorded in ``model.ignored_kv_scales``: harmless with a
    cache in the model's dtype, refused for an FP8 cache (``check_kv_scales_used``).

    Raises:
        ValueError: naming the tensor: a scale that is not one finite positive value.
    """
    modules = dict(model.named_modules())
    ignored: list[str] = []
    vars(model)["ignored_kv_scales"] = ignored  # a plain attribute, not a submodule
    for name, tensor in weights:
        target = kv_scale_target(name)
        if target is None:
            yield name, tensor
            continue
        module_name, which = target
        value = _scalar(name, tensor)
        module = modules.get(module_name)
        shard = getattr(model, "shard", None)
        if module is None and shard is not None and not shard.holds_hf_weight(name):
            continue  # a layer of another pipeline stage
        if module is None or not (hasattr(module, "k_scale") and hasattr(module, "v_scale")):
            ignored.append(name)
            continue
        if "k" in which:
            module.k_scale = value
        if "v" in which:
            module.v_scale = value


def check_kv_scales_used(model: nn.Module) -> None:
    """Refuse an FP8 KV cache for a model that had to ignore its checkpoint's calibrated
    KV scales (quantizing with 1.0 instead would clamp what the scales were made for).

    Raises:
        ValueError: naming ``kv_cache_dtype`` and the first ignored scale tensors.
    """
    ignored = getattr(model, "ignored_kv_scales", None)
    if ignored:
        raise ValueError(f"kv_cache_dtype: {type(model).__name__} cannot apply the "
                         f"checkpoint's calibrated KV cache scales ({', '.join(ignored[:2])}"
                         f"{', ...' if len(ignored) > 2 else ''}); use kv_cache_dtype auto "
                         "or tandem's native implementation (model_impl tandem)")
