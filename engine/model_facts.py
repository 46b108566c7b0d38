"""Facts about the loaded model, found once at start-up and never changed.

The engine core, the services and the benchmarks read the model's vocabulary size,
context length, EOS id and KV geometry from this one value, which the executor
reports after its workers loaded the weights. Nothing here imports torch, so code
that only needs the facts (services, tests of the seam) stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFacts:
    """What the loaded model is; the same on every worker of one engine.

    Attributes:
        model_id: stable name of the model (GGUF file stem or folder name); part of
            the KV layout fingerprint.
        vocab_size: number of token ids; valid ids are ``[0, vocab_size)``.
        max_model_len: context length in tokens (prompt + output) the engine serves:
            ``ModelConfig.max_model_len`` or the model's ``max_position_embeddings``.
        eos_token_id: the tokenizer's end-of-sequence id, ``None`` when it has none.
        num_layers: transformer layers, each with its own K and V cache.
        num_kv_heads: KV heads per layer (of the whole model, before any sharding).
        head_dim: elements of one attention head.
        dtype: dtype name of weights and KV cache, e.g. "bfloat16" (no "torch." prefix).
        device: device of weights and KV cache, e.g. "cpu" or "cuda:0".

    Raises:
        ValueError: naming the field, for a count below 1.
    """

    model_id: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


def rope_params(config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling | None)`` from a transformers 4.x or 5.x config."""
    params = getattr(config, "rope_parameters", None)
    if params:
        theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return theta, (dict(params) if rope_type != "default" else None)
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def head_dim_of(config: Any) -> int:
    """Attention head dimension (explicit ``head_dim`` or hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
