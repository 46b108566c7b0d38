"""Quantized weights (vLLM's ``quantization``): which method a model runs with, and the
layers that replace its linear projections.

``resolve_quantization`` picks the method: the checkpoint's
``quantization_config.quant_method`` (gptq, awq, compressed-tensors, fp8) by default, or
an on-load method (int8, int4) asked for an unquantized checkpoint. ``build_model``
(``engine/models/registry.py``) then calls ``prepare_model`` (the decoder projections
become the method's ``QuantLinear`` on the meta device, with the checkpoint's packed
tensors as parameters), feeds the weights through ``filter_weights`` into the model's
``load_weights`` (``engine/models/llama.py`` hands each quantized tensor to
``base.load_quant_part``, which puts a fused projection's parts side by side along the
output axis), and calls ``finish_model`` (each layer validates and repacks; an on-load
method quantizes the loaded full-precision layers).

Adding a method:

1. Subclass ``base.QuantizationMethod``: ``name`` (the ``--quantization`` value),
   ``from_config`` (parse ``quantization_config``; raise ``ValueError`` naming any bit
   width, group size, format or option you do not support: never fall back silently),
   and ``create_linear`` (checkpoint methods) or ``quantize_linear`` with
   ``on_load = True`` (on-load methods); optionally ``quantizes`` and ``skip_tensor``.
2. Its layer subclasses ``base.QuantLinear``: register each checkpoint tensor with
   ``add_checkpoint_param`` saying how it meets the output axis (``out_dim``,
   ``out_pack`` for packed or blocked entries, ``per_part``, ``shared``), repack in
   ``finish_loading`` (errors name ``<prefix>.<tensor>``), compute in ``forward``. An
   integer format can end as ``grouped_linear.GroupQuantLinear`` (``set_weights``) and
   get its kernels for free (``kernels/quant/grouped.py``).
3. Register it in ``QUANTIZATION_METHODS`` below; ``--quantization`` choices, the
   config check and the Helm schema read that list (update the schema's enum).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tandem.engine.quantization.awq import AWQMethod
from tandem.engine.quantization.base import (
    QuantizationMethod,
    QuantLinear,
    is_quant_param,
    load_quant_part,
)
from tandem.engine.quantization.compressed_tensors import CompressedTensorsMethod
from tandem.engine.quantization.gguf import GGUFMethod, NoQuantization
from tandem.engine.quantization.gptq import GPTQMethod
from tandem.engine.quantization.methods import Fp8Method, Int4OnLoad, Int8OnLoad

__all__ = [
    "QUANTIZATION_METHODS", "QuantLinear", "QuantizationMethod", "finish_model",
    "filter_weights", "is_quant_param", "load_quant_part", "prepare_model",
    "resolve_quantization", "weight_bytes",
]

logger = logging.getLogger(__name__)

#: ``--quantization`` value -> method (vLLM's names)
QUANTIZATION_METHODS: dict[str, type[QuantizationMethod]] = {
    m.name: m for m in (GPTQMethod, AWQMethod, CompressedTensorsMethod, Fp8Method,
                        Int8OnLoad, Int4OnLoad, GGUFMethod, NoQuantization)
}

#: Architectures whose projections the methods replace (Llama's layers and loader).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict, or ``None``."""
    qcfg = getattr(hf_config, "quantization_config", None)
    if qcfg is None:
        return None
    if not isinstance(qcfg, dict):
        qcfg = qcfg.to_dict() if hasattr(qcfg, "to_dict") else dict(vars(qcfg))
    return qcfg


def _method_name(value: Any) -> str:
    """A ``quant_method`` as its lower-case name: transformers' config classes hold a
    ``QuantizationMethod`` enum (whose ``str()`` is ``'QuantizationMethod.GPTQ'``), a
    ``config.json`` the plain string."""
    return str(getattr(value, "value", value)).lower()


def resolve_quantization(requested: str | None, hf_config: Any) -> QuantizationMethod | None:
    """The method to run ``hf_config``'s checkpoint with.

    Args:
        requested: ``ModelConfig.quantization`` (``None``: the checkpoint's own).
        hf_config: the transformers config (its ``quantization_config``, if any).

    Raises:
        ValueError: naming ``quantization``: an unknown method (requested or in the
            checkpoint), a request that contradicts the checkpoint's method, a checkpoint
            method asked for an unquantized checkpoint, an on-load method asked for a
            quantized one; or the method's own refusal of a setting.
    """
    qcfg = checkpoint_quant_config(hf_config)
    found = None if qcfg is None else _method_name(qcfg.get("quant_method", ""))
    if found is not None and found not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization: the checkpoint's quant_method {found!r} is not "
                         f"supported (supported: {', '.join(QUANTIZATION_METHODS)})")
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                         f"got {requested!r}")
    name = requested or found
    if name is None:
        return None
    cls = QUANTIZATION_METHODS[name]
    if found is not None and requested is not None and requested != found:
        raise ValueError(f"quantization {requested!r} was asked for, but the checkpoint is "
                         f"quantized with {found!r}")
    if found is None and not cls.on_load and name != "fp8":
        raise ValueError(f"quantization {name!r} needs a checkpoint quantized with it (no "
                         "quantization_config in config.json); int8 and int4 quantize on load")
    if found is not None and cls.on_load:
        raise ValueError(f"quantization {name!r} quantizes unquantized checkpoints only")
    return cls.from_config(qcfg or {})


def _arch_check(model: nn.Module, method: QuantizationMethod) -> None:
    if type(model).__name__ not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"quantization {method.name!r} is not supported for "
                         f"{type(model).__name__} (supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    shard = getattr(model, "shard", None)
    if shard is not None and shard.tp_size > 1:
        raise ValueError(f"quantization {method.name!r} is not supported with "
                         "tensor_parallel_size > 1 yet")


def _targets(model: nn.Module, method: QuantizationMethod
             ) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    return [
        (parent, child_name, f"{name}.{child_name}" if name else child_name, child)
        for name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if type(child) is nn.Linear and child_name in _TARGETS and ".layers." in f".{name}"
        and method.quantizes(f"{name}.{child_name}")
    ]


def prepare_model(model: nn.Module, method: QuantizationMethod, dtype: torch.dtype) -> int:
    """Replace the decoder projections of ``model`` (built on the meta device) by the
    checkpoint method's layers; nothing for an on-load method. Returns the count.

    Raises:
        ValueError: an unsupported architecture or TP > 1 (naming ``quantization``), or
            the method's refusal of a layer's shape.
    """
    _arch_check(model, method)
    if method.on_load:
        return 0
    targets = _targets(model, method)
    for parent, child_name, prefix, linear in targets:
        fused = getattr(model, "_shard_offsets", None)
        parts = [linear.out_features]
        if fused is not None and child_name in ("qkv_proj", "gate_up_proj"):
            offsets = fused(child_name)
            parts = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
        setattr(parent, child_name, method.create_linear(linear, parts, prefix, dtype))
    return len(targets)


def filter_weights(weights: Iterable[tuple[str, torch.Tensor]], method: QuantizationMethod
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` without the tensors ``method.skip_tensor`` drops."""
    for name, tensor in weights:
        if not method.skip_tensor(name, tensor):
            yield name, tensor


def finish_model(model: nn.Module, method: QuantizationMethod) -> None:
    """After ``load_weights``: repack every ``QuantLinear``; an on-load method replaces
    the loaded projections by quantized ones. Logs the weight bytes."""
    before = weight_bytes(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            module.finish_loading(name)
    if method.on_load:
        for parent, child_name, prefix, linear in _targets(model, method):
            setattr(parent, child_name, method.quantize_linear(linear, prefix))
        _quantize_head(model, method)
    logger.info("quantization %s: weights take %.1f MB (%.1f MB loaded)", method.name,
                weight_bytes(model) / 1e6, before / 1e6)


def _quantize_head(model: nn.Module, method: QuantizationMethod) -> None:
    """Give ``model`` the method's quantized LM head (``quantize_head``), if it has one:
    an own ``lm_head`` is replaced; a tied head becomes ``tied_lm_head``, a quantized copy
    of the token embedding (the lookup keeps reading the embedding itself)."""
    lm_head = getattr(model, "lm_head", None)
    if type(lm_head) is nn.Linear:
        head = method.quantize_head(lm_head.weight, lm_head.bias)
        if head is not None:
            model.lm_head = head
        return
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(embed, "weight", None)
    if (lm_head is None and getattr(model, "tied_lm_head", False) is None
            and isinstance(weight, torch.Tensor) and weight.device.type != "meta"):
        head = method.quantize_head(weight, None)
        if head is not None:
            model.tied_lm_head = head


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (each storage counted once)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
