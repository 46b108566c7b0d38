"""One worker: the model runner of one rank, driven by an executor (vLLM v1's ``Worker``).

A worker loads the weights, sizes and allocates its share of the paged KV cache and
runs one forward step per ``SchedulerOutput``. It knows nothing of queues or blocks
beyond the block tables it is handed: the scheduler stays in the engine core, and an
executor decides how many workers there are and where they live (in-process today;
one process per rank when tensor/pipeline parallel lands).

Lifecycle, in order: ``load_model`` -> ``determine_num_blocks`` ->
``initialize_kv_cache`` -> ``execute_model``... -> ``shutdown``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.model_facts import ModelFacts
from tandem.engine.model_loader import LoadedModel
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Worker:
    """The model runner of one rank.

    Args:
        config: the engine's frozen configuration.
        rank: this worker's rank in ``[0, tensor_parallel_size * pipeline_parallel_size)``.
        loaded: an already loaded model (``model_loader.load_model``) to wrap instead of
            loading ``config.model``; tests reuse one model across engines. In-process only.

    Raises:
        ValueError: ``rank`` outside the world the parallel config describes.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, loaded: LoadedModel | None = None):
        par = config.parallel
        world_size = par.tensor_parallel_size * par.pipeline_parallel_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.config = config
        self.rank = rank
        self._loaded = loaded
        self._runner: ModelRunner | None = None

    @property
    def model_runner(self) -> ModelRunner:
        """This worker's model runner.

        Raises:
            RuntimeError: before ``load_model`` or after ``shutdown``.
        """
        if self._runner is None:
            raise RuntimeError("the worker has no model: call load_model() (or it was shut down)")
        return self._runner

    def load_model(self) -> None:
        """Load the weights (or wrap the given model) and build the model runner.

        Blocks for the whole load (seconds for a GGUF file on a small CPU).

        Raises:
            ValueError: from the loader (unknown model path, unsupported architecture) or
                ``max_model_len`` beyond the model's positions.
            RuntimeError: when a model is already loaded.
        """
        if self._runner is not None:
            raise RuntimeError("load_model() called twice")
        self._runner = ModelRunner(self.config, self._loaded)
        self._loaded = None  # the runner holds it now

    def model_facts(self) -> ModelFacts:
        """The loaded model's facts (vocabulary, context length, EOS id, KV geometry):
        the full model's layers and KV heads on every rank, whatever part of them this
        rank holds (they define the KV layout fingerprint)."""
        return self.model_runner.facts

    @property
    def is_driver(self) -> bool:
        """Whether this rank returns the step's output (last pipeline stage, first
        tensor-parallel rank: the one that samples)."""
        return self.model_runner.is_driver

    def shard_info(self) -> dict[str, Any]:
        """What the executor needs to know of this rank, after ``load_model``: the full
        model's ``facts``, ``has_tokenizer``, which part of the full KV cache this rank's
        cache holds (``layer_range``, ``kv_head_range``: ranges into the full model's
        layers and KV heads) and its ``block_bytes`` (one block of its own cache)."""
        r = self.model_runner
        return {
            "facts": self.model_facts(),
            "has_tokenizer": r.loaded.tokenizer is not None,
            "layer_range": r.layer_range,
            "kv_head_range": r.kv_head_range,
            "block_bytes": r.block_bytes,
        }

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The Hugging Face tokenizer loaded with the weights (``None`` when the model
        folder has none)."""
        return self.model_runner.loaded.tokenizer

    def determine_num_blocks(self) -> int:
        """KV blocks this worker's memory budget holds (``ModelRunner.determine_num_blocks``:
        the override, the explicit byte budget, or a profile of what the weights and the
        largest step leave). Blocks for the profiling forward on CUDA; allocates nothing
        that outlives the call.

        Raises:
            ValueError: when the budget holds less than one block.
        """
        return self.model_runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int, shared_file: str | None = None) -> None:
        """Allocate the zeroed KV cache of ``num_blocks`` blocks (replacing any earlier one);
        ``shared_file``: CPU only, map this zero-filled file as the cache so that another
        process can map it too (``kernels.cache.allocate_kv_cache``).

        Raises:
            ValueError: ``num_blocks`` < 1, or ``shared_file`` off the CPU.
        """
        self.model_runner.initialize_kv_cache(num_blocks, shared_file)

    @property
    def kv_cache(self) -> torch.Tensor:
        """The KV cache tensor
        ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (dtype of the
        model), what a KV connector's worker side reads and writes: this rank's layers
        and KV heads (``ModelRunner.layer_range`` / ``kv_head_range``).

        Raises:
            RuntimeError: before ``initialize_kv_cache``.
        """
        kv = self.model_runner.kv_cache
        if kv is None:
            raise RuntimeError("the KV cache is not allocated: call initialize_kv_cache()")
        return kv

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward step (``ModelRunner.execute_model``): writes the step's K/V into
        the cache, mutates no request; blocks until the step's tokens are sampled."""
        return self.model_runner.execute_model(sched)

    def shutdown(self) -> None:
        """Drop the model runner and with it this worker's KV cache and weights (unless
        the caller still holds the model it passed in). Idempotent."""
        self._runner = None
