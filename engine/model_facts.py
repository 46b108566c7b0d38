"""Facts about the loaded model, found once at start-up and never changed.

The engine core, the services and the benchmarks read the model's vocabulary size,
context length, EOS id and KV geometry from this one value, which the executor
reports after its workers loaded the weights. The rules that turn a model's config into
those facts (its context length, the served ``max_model_len``, the head layout) are
defined here once: ``resolve_model_facts`` and the readers it uses. Nothing here imports
torch, so code that only needs the facts (services, tests of the seam) stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.contracts.kv_layout import KVCacheSpec

#: context length (tokens) of a model whose config states none
DEFAULT_MAX_MODEL_LEN = 2048


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
        num_kv_heads: KV heads per layer (of the whole model, before any sharding); 1 for
            an "mla" cache.
        head_dim: elements of one cached head: the attention head, or for an "mla" cache
            the latent entry's ``kv_lora_rank + qk_rope_head_dim``.
        dtype: dtype name of weights and KV cache, e.g. "bfloat16" (no "torch." prefix).
        device: device of weights and KV cache, e.g. "cpu" or "cuda:0".
        architecture: ``config.architectures[0]``, e.g. "LlamaForCausalLM" ("" if unknown).
        model_impl: the implementation serving it: "tandem" (native) or "transformers".
        kv_kind: the cache kind, "mha" (per-head K and V) or "mla" (DeepSeek's latent), see
            ``contracts.kv_layout.KVCacheSpec``.
        kv_rope_dim: "mla": the rotary elements at the end of the latent entry (else 0).
        kv_cache_dtype: dtype name of the KV cache when it differs from ``dtype`` (an FP8
            cache: "float8_e4m3fn" or "float8_e5m2"), "" when the cache has ``dtype``.
        kv_scales: an FP8 cache's scales' identity (``kernels.kv_quant.scales_id``), "".
        weight_bytes: bytes of this rank's weights as they sit in memory (quantized or
            packed where they are), 0 when not measured.

    Raises:
        ValueError: naming the field, for a count below 1 or an inconsistent KV spec.
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
    architecture: str = ""
    model_impl: str = "tandem"
    kv_kind: str = "mha"
    kv_rope_dim: int = 0
    kv_cache_dtype: str = ""
    kv_scales: str = ""
    weight_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        # kind, heads and rope_dim are valid only together: the spec checks them
        KVCacheSpec(self.kv_kind, self.num_kv_heads, self.head_dim, self.kv_rope_dim)

    @property
    def cache_dtype(self) -> str:
        """dtype name of the KV cache: ``kv_cache_dtype`` or, when unset, ``dtype``."""
        return self.kv_cache_dtype or self.dtype

    @property
    def kv_spec(self) -> KVCacheSpec:
        """What each layer caches per token (the whole model's heads)."""
        return KVCacheSpec(self.kv_kind, self.num_kv_heads, self.head_dim, self.kv_rope_dim)


def kv_cache_spec(config: Any, model_impl: str = "tandem") -> KVCacheSpec:
    """The KV cache a model's implementation keeps per token and layer.

    A config with ``kv_lora_rank`` (DeepSeek-V2/V3, Kimi-K2: multi-head latent attention)
    served natively caches the latent: ``KVCacheSpec.mla(kv_lora_rank, qk_rope_head_dim)``.
    Everything else, MLA models through the Transformers backend included (its attention
    sees K and V expanded to every head), caches per-head K and V of ``num_key_value_heads``
    (else ``num_attention_heads``) heads of ``head_dim_of(config)``.

    Raises:
        ValueError: a count below 1 (``KVCacheSpec``).
    """
    rank = getattr(config, "kv_lora_rank", None)
    if model_impl == "tandem" and rank:
        return KVCacheSpec.mla(int(rank), int(config.qk_rope_head_dim))
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return KVCacheSpec.mha(int(heads), int(head_dim_of(config)))


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


def _field(config: Any, name: str) -> Any:
    """``name`` of a transformers config object or of a ``config.json`` mapping."""
    return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)


def model_context_len(config: Any) -> int:
    """The context length a model's config states (``max_position_embeddings``, of its text
    config where it nests one), ``DEFAULT_MAX_MODEL_LEN`` when it states none.

    Args:
        config: a transformers ``PretrainedConfig`` or a ``config.json`` mapping.
    """
    text = _field(config, "text_config")
    context = _field(text, "max_position_embeddings") if text is not None else None
    if context is None:
        context = _field(config, "max_position_embeddings")
    return int(context) if isinstance(context, int) and context > 0 else DEFAULT_MAX_MODEL_LEN


def resolve_max_model_len(requested: int | None, context: int) -> int:
    """The context length (tokens) an engine serves: ``requested`` (``max_model_len``) or
    the model's own ``context``.

    Raises:
        ValueError: naming ``max_model_len``, when ``requested`` exceeds ``context``.
    """
    if requested is None:
        return context
    if requested > context:
        raise ValueError(f"max_model_len {requested} exceeds the model's "
                         f"max_position_embeddings {context}")
    return requested


def architecture_of(config: Any) -> str:
    """``config.architectures[0]``, or "" when the config names none."""
    archs = _field(config, "architectures") or []
    return str(archs[0]) if archs else ""


def resolve_model_facts(
    hf_config: Any,
    max_model_len: int | None,
    *,
    model_id: str,
    eos_token_id: int | None,
    dtype: str,
    device: str,
    model_impl: str = "tandem",
    architecture: str | None = None,
    weight_bytes: int = 0,
) -> ModelFacts:
    """The ``ModelFacts`` of a loaded model: the one place its config becomes facts.

    Args:
        hf_config: the model's transformers config.
        max_model_len: the engine's requested context length (``ModelConfig.max_model_len``)
            or None for the model's own.
        model_id / eos_token_id / dtype / device / model_impl: as in ``ModelFacts``.
        architecture: as in ``ModelFacts``; default ``config.architectures[0]``.
        weight_bytes: as in ``ModelFacts``.

    Raises:
        ValueError: ``max_model_len`` beyond the model's context, or a count below 1.
    """
    spec = kv_cache_spec(hf_config, model_impl)
    return ModelFacts(
        model_id=model_id,
        vocab_size=int(hf_config.vocab_size),
        max_model_len=resolve_max_model_len(max_model_len, model_context_len(hf_config)),
        eos_token_id=eos_token_id,
        num_layers=int(hf_config.num_hidden_layers),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=dtype.removeprefix("torch."),
        device=device,
        architecture=architecture if architecture is not None else architecture_of(hf_config),
        model_impl=model_impl,
        kv_kind=spec.kind,
        kv_rope_dim=spec.rope_dim,
        weight_bytes=weight_bytes,
    )
