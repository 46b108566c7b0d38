"""Our model implementations (Llama, Mistral, Qwen2, Qwen3) and their registry."""

from __future__ import annotations

from tandem.engine.models.registry import (
    MODEL_REGISTRY,
    build_model,
    get_model_class,
    supported_architectures,
)

__all__ = ["MODEL_REGISTRY", "build_model", "get_model_class", "supported_architectures"]
