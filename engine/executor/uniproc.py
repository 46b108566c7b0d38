"""The "uni" executor backend: one worker in the engine core's own process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.engine.config import EngineConfig
from tandem.engine.executor.abstract import Executor
from tandem.engine.model_facts import ModelFacts
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.worker import Worker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tandem.engine.kv_connector import KVConnectorWorker
    from tandem.engine.model_loader import LoadedModel


class UniProcExecutor(Executor):
    """One in-process ``Worker`` (rank 0) whose calls are plain method calls.

    Args:
        config: the engine's frozen configuration (one worker: 1 x 1 parallel).
        loaded: an already loaded model to wrap instead of loading ``config.model``.

    Raises:
        ValueError: from the loader (unknown model path, unsupported architecture).
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        par = config.parallel
        assert par.tensor_parallel_size * par.pipeline_parallel_size == 1, (
            "ParallelConfig lets 'uni' run only one worker"
        )
        self.driver_worker = Worker(config, rank=0, loaded=loaded)
        self.driver_worker.load_model()
        self._facts = self.driver_worker.model_facts()

    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.driver_worker.tokenizer

    def determine_num_blocks(self) -> int:
        return self.driver_worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.driver_worker.initialize_kv_cache(num_blocks)

    def register_kv_caches(self, connector_worker: KVConnectorWorker) -> None:
        connector_worker.register_kv_caches(self.driver_worker.kv_cache)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
