"""The seam between the engine core and the workers that run the model (vLLM v1's
``Executor``).

The engine core owns the scheduler and the KV connector; everything that touches
weights or the KV cache goes through an ``Executor``: load the model on every worker,
size the KV cache from the memory budget, allocate it, run one step, hand the cache to
the connector's worker side, shut down. An executor backend decides where the workers
live (``ParallelConfig.distributed_executor_backend``): "uni" runs one ``Worker`` in
this process; "mp" runs one worker process per tensor/pipeline-parallel rank and
broadcasts each step to all of them, without touching the scheduler.

This module imports no torch: the factory imports a backend only when it builds one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tandem.engine.config import EngineConfig
from tandem.engine.errors import EngineDeadError
from tandem.engine.model_facts import ModelFacts
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput

__all__ = ["EngineDeadError", "Executor", "create_executor"]

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandem.engine.kv_connector import KVConnectorWorker
    from tandem.engine.model_loader import LoadedModel


class Executor(ABC):
    """Runs the model for an engine core on one or more workers.

    Construction loads the model on every worker (blocking; seconds) and leaves the KV
    cache unallocated. The engine core then calls, in order: ``determine_num_blocks``,
    ``initialize_kv_cache``, ``register_kv_caches`` (with a connector only), then
    ``execute_model`` (or ``submit_step``, up to ``max_concurrent_batches`` steps ahead)
    once per non-empty step, and ``shutdown`` last. Every method is called from the
    engine core's one thread.
    """

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may have submitted and not yet collected (vLLM's name):
        more than 1 only where the workers can overlap steps (pipeline stages)."""
        return 1

    def submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start one step and return at once with its future (vLLM's
        ``execute_model(non_block=True)``); ``result()`` is ``execute_model``'s return
        value or raises its error. Steps run in submission order; the engine core
        collects their futures in that order.

        This default runs the step now: the future is already done.
        """
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as exc:  # noqa: BLE001 - handed to the caller through result()
            future.set_exception(exc)
        return future

    @property
    @abstractmethod
    def model_facts(self) -> ModelFacts:
        """The loaded model's facts (the same on every worker); fixed after construction."""

    @property
    @abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's Hugging Face tokenizer, or ``None`` for a model folder without one
        (the engine then takes token ids only)."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """Number of KV blocks the cache gets: ``CacheConfig.num_blocks_override``, else
        the memory budget (``kv_cache_memory_bytes``, or ``gpu_memory_utilization`` of what
        the weights and the largest step leave) divided by one block's bytes; the
        minimum over workers. Allocates nothing that outlives the call; may run a
        profiling forward (blocks for it).

        Raises:
            ValueError: when the budget holds less than one block.
        """

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate a zeroed KV cache of ``num_blocks`` blocks on every worker.

        Raises:
            ValueError: ``num_blocks`` < 1.
        """

    @abstractmethod
    def register_kv_caches(self, connector_worker: KVConnectorWorker) -> None:
        """Hand each worker's KV cache tensor
        ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` to the KV
        connector's worker side (``KVConnectorWorker.register_kv_caches``). Called once,
        after ``initialize_kv_cache`` and before the first step.

        Raises:
            RuntimeError: before ``initialize_kv_cache``.
            ValueError: from the connector, when the tensor does not match its layout.
        """

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; blocks until its tokens are sampled.

        Feeds each scheduled request's next ``num_scheduled_tokens`` tokens, writes their
        K/V into the blocks of its block table and samples the requests that reached the
        end of their known tokens. Mutates the KV cache only; request state is the
        scheduler's to advance (``SchedulerOutput``'s contract).

        Returns:
            The sampled token (and logprobs when asked) of every request sampled this
            step, from the driver worker (rank 0).

        Raises:
            RuntimeError: before ``initialize_kv_cache`` or after ``shutdown``.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (their KV caches and weights). Idempotent; no method but
        ``shutdown`` may be called afterwards."""


def create_executor(config: EngineConfig, loaded: LoadedModel | None = None) -> Executor:
    """Build the executor ``config.parallel.distributed_executor_backend`` names; the one
    place that maps a backend name to a class. Blocks while the model loads.

    Args:
        config: the engine's frozen configuration.
        loaded: an already loaded model to reuse (tests share one across engines); only
            the in-process "uni" backend can take one.

    Raises:
        ValueError: from the loader (unknown model path, unsupported architecture).
    """
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":
        from tandem.engine.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config, loaded)
    # NOTE: ParallelConfig already rejects any other name; the assert guards a
    # backend added to the config without a branch here.
    assert backend == "uni", f"no executor for distributed_executor_backend {backend!r}"
    from tandem.engine.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, loaded)
