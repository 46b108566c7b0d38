"""Model registry: ``config.architectures[0]`` -> the implementation that runs it.

Two implementations (vLLM's ``--model-impl``): tandem's native ones (``MODEL_REGISTRY``)
and the Transformers modeling backend (``transformers_backend.py``: transformers' own
modeling code over tandem's paged attention). ``model_impl="auto"`` takes the native one
where the architecture has one, else transformers (``resolve_model_impl``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tandem.engine import quantization as quant
from tandem.engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tandem.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tandem.engine.models.gpt_oss import GptOssForCausalLM
from tandem.engine.models.interface import CausalLM
from tandem.engine.models.kv_scales import take_kv_scales
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.mistral import MistralForCausalLM
from tandem.engine.models.moe_models import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from tandem.engine.models.phi3 import Phi3ForCausalLM
from tandem.engine.models.qwen2 import Qwen2ForCausalLM
from tandem.engine.models.qwen3 import Qwen3ForCausalLM
from tandem.engine.quantization import QuantizationMethod

#: architecture name (``config.architectures[0]``) -> tandem's native implementation
MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


#: ``ModelConfig.model_impl`` values
ModelImpl = Literal["auto", "tandem", "transformers"]
MODEL_IMPLS: tuple[str, ...] = ("auto", "tandem", "transformers")


#: ``model_type`` -> architecture, for configs without ``architectures`` (GGUF-derived and
#: hand-built ones)
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def _arch_of(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return str(archs[0]) if archs else str(getattr(config, "model_type", None))


def architecture_name(config: Any) -> str:
    """The architecture ``config`` describes: ``architectures[0]``, else the one its
    ``model_type`` maps to (tandem's native names, then transformers' causal-LM mapping),
    else the ``model_type`` itself."""
    archs = getattr(config, "architectures", None) or []
    if archs:
        return str(archs[0])
    model_type = str(getattr(config, "model_type", None))
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return model_type
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return str(cls.__name__)


def resolve_model_impl(config: Any, model_impl: str = "auto") -> str:
    """Which implementation runs ``config``: "tandem" (native) or "transformers".

    ``auto``: native where ``MODEL_REGISTRY`` has the architecture, else the Transformers
    backend where it can serve the config; ``tandem`` / ``transformers``: that one.

    Raises:
        ValueError: naming ``model_impl`` for an unknown value; naming the architecture
            (and both implementations, with the Transformers backend's reason) when
            neither serves it.
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    native = ", ".join(supported_architectures())
    if model_impl in ("auto", "tandem"):
        try:
            get_model_class(config)
            return "tandem"
        except ValueError:
            if model_impl == "tandem":
                raise ValueError(
                    f"model architecture {_arch_of(config)!r} has no native tandem "
                    f"implementation (model_impl='tandem'; native: {native}); "
                    "model_impl='auto' or 'transformers' runs transformers' modeling code"
                ) from None
    from tandem.engine.models.transformers_backend import check_supported

    try:
        check_supported(config)
    except ValueError as e:
        raise ValueError(
            f"model architecture {_arch_of(config)!r} is not supported: tandem's native "
            f"implementations cover {native}, and the Transformers modeling backend "
            f"(model_impl='transformers') refuses it: {e}"
        ) from None
    return "transformers"


def get_model_class(config: Any) -> type[torch.nn.Module]:
    """The class for ``config.architectures[0]``.

    Raises:
        ValueError: naming the architecture and listing the supported ones.
    """
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(
        getattr(config, "model_type", ""), str(getattr(config, "model_type", None)))
    cls = MODEL_REGISTRY.get(arch)
    if cls is None:
        raise ValueError(
            f"model architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    return cls


def build_model(
    config: Any,
    weights: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    max_position: int,
    model_impl: str = "auto",
    quantization: QuantizationMethod | None = None,
) -> CausalLM:
    """Instantiate our model for ``config`` and load ``weights`` into it.

    The modules are created on the meta device (no random init, no memory),
    materialised uninitialised in ``dtype`` on ``device``, then filled.

    Args:
        config: transformers config.
        weights: iterable of ``(hf_name, tensor)`` or a state dict.
        dtype / device: of the parameters.
        max_position: rotary table length in tokens.
        model_impl: "auto", "tandem" or "transformers" (``resolve_model_impl``).
        quantization: the method the weights are quantized with (``engine/quantization``;
            ``resolve_quantization``), or ``None``.

    Raises:
        ValueError: unsupported architecture, or weights that do not fit.
    """
    cls: type[torch.nn.Module]
    if resolve_model_impl(config, model_impl) == "tandem":
        cls = get_model_class(config)
    else:
        from tandem.engine.models.transformers_backend import TransformersForCausalLM

        cls = TransformersForCausalLM
    with torch.device("meta"):
        model = cls(config, max_position=max_position, dtype=dtype, device=device)
    model = model.to(dtype=dtype)
    if quantization is not None:  # after .to(dtype): it keeps the packed tensors' dtypes
        quant.prepare_model(model, quantization, dtype)
    model = model.to_empty(device=device)
    if isinstance(weights, dict):
        weights = weights.items()
    assert isinstance(model, CausalLM), f"{cls.__name__} does not implement CausalLM"
    if quantization is not None:
        weights = quant.filter_weights(weights, quantization)
    model.load_weights(take_kv_scales(model, weights))
    if quantization is not None:
        quant.finish_model(model, quantization)
    model.eval().requires_grad_(False)
    return model
