"""Model registry: ``config.architectures[0]`` -> our implementation."""

from __future__ import annotations

from typing import Any

import torch

from tandem.engine.models.interface import CausalLM
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.mistral import MistralForCausalLM
from tandem.engine.models.qwen2 import Qwen2ForCausalLM
from tandem.engine.models.qwen3 import Qwen3ForCausalLM

#: architecture name (``config.architectures[0]``) -> tandem's native implementation
MODEL_REGISTRY: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(config: Any) -> type[torch.nn.Module]:
    """The class for ``config.architectures[0]``.

    Raises:
        ValueError: naming the architecture and listing the supported ones.
    """
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else None
    if arch is None:
        # GGUF-derived and hand-built configs may lack `architectures`.
        arch = {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }.get(getattr(config, "model_type", ""), str(getattr(config, "model_type", None)))
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
) -> CausalLM:
    """Instantiate our model for ``config`` and load ``weights`` into it.

    The modules are created on the meta device (no random init, no memory),
    materialised uninitialised in ``dtype`` on ``device``, then filled.

    Args:
        config: transformers config.
        weights: iterable of ``(hf_name, tensor)`` or a state dict.
        dtype / device: of the parameters.
        max_position: rotary table length in tokens.

    Raises:
        ValueError: unsupported architecture, or weights that do not fit.
    """
    cls = get_model_class(config)
    with torch.device("meta"):
        model = cls(config, max_position=max_position, dtype=dtype, device=device)
    model = model.to(dtype=dtype).to_empty(device=device)
    if isinstance(weights, dict):
        weights = weights.items()
    assert isinstance(model, CausalLM), f"{cls.__name__} does not implement CausalLM"
    model.load_weights(weights)
    model.eval().requires_grad_(False)
    return model
