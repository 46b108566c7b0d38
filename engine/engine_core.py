"""Token-in, token-out engine: the loop every tandem service drives.

One ``EngineCore`` owns an executor (the workers that hold the weights and the
paged KV cache: ``engine/executor/``), a scheduler (queues, blocks, prefix cache)
and, in disaggregated roles, both sides of a KV connector. It reaches the model
only through the executor's interface. ``step()`` runs one iteration of continuous
batching (vLLM v1's ``EngineCore.step``):

    schedule -> connector.start_load_kv -> executor.execute_model (skipped when
    nothing is scheduled) -> connector.save_kv -> connector.get_finished ->
    update_from_output

With more than one batch in flight (``Executor.max_concurrent_batches`` > 1: pipeline
parallelism) ``step()`` is vLLM v1's ``step_with_batch_queue``: while fewer batches than
that are in flight and the scheduler has something to run, it schedules and submits
one (returning no outputs); otherwise it waits for the oldest batch, then runs the
connector's ``save_kv``/``get_finished`` and ``update_from_output`` for it. Batches are
applied in submission order and a request is in at most one of them (the scheduler's
batch queue rules), so each request's outputs stay in order.

The engine is single-threaded: callers serialize ``add_request`` / ``abort_requests``
/ ``step`` (the services run it in one dedicated thread).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import EngineConfig
from tandem.engine.cpu_turns import CpuTurns
from tandem.engine.executor import Executor, create_executor
from tandem.engine.kv_events import KVEventPublisher, create_kv_event_publisher
from tandem.engine.model_facts import ModelFacts
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.structured_output.manager import StructuredOutputManager
from tandem.engine.validation import (
    RequestError,
    RequestLimits,
    check_priority,
    validate_request,
)

if TYPE_CHECKING:
    from tandem.engine.kv_connector import KVConnectorScheduler, KVConnectorWorker
    from tandem.engine.structured_output.backend import XgrammarBackend

logger = logging.getLogger(__name__)


class EngineCore:
    """Continuous-batching engine over token ids.

    Args:
        config: the engine's frozen configuration.
        executor: the executor that runs the model, built from this ``config``
            (``executor.create_executor``; tests pass one wrapping a shared model, or a
            fake); ``None`` builds it from ``config`` (loads the model). The core owns
            it from here on: ``shutdown`` shuts it down.
        structured_output: the grammar manager of constrained requests (tests pass one
            over a tiny vocabulary); ``None`` builds one over the model's tokenizer,
            whose xgrammar backend is made when the first constrained request arrives.

    Attributes:
        executor: the executor; the core's only way to the model.
        model_facts: the loaded model's facts (vocabulary, context length, EOS id,
            KV geometry), as the executor reported them.
        num_blocks: KV blocks of the cache (what the executor's budget held).
        num_steps: batches submitted to the executor (steps that ran the model).
        max_num_batches_in_flight: the most batches that were in flight at once.

    Raises:
        ValueError: unknown model path or unsupported architecture (from the loader),
            or a KV budget that holds no block.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        from tandem.engine.scheduler import Scheduler

        self.config = config
        self.executor = executor if executor is not None else create_executor(config)
        self.model_facts: ModelFacts = self.executor.model_facts
        num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.max_model_len: int = self.model_facts.max_model_len
        self.vocab_size: int = self.model_facts.vocab_size
        self.eos_token_id: int | None = self.model_facts.eos_token_id

        self.connector_scheduler: KVConnectorScheduler | None = None
        self.connector_worker: KVConnectorWorker | None = None
        if config.kv_transfer.kv_connector is not None:
            from tandem.engine.kv_connector import create_connector

            pair = create_connector(config.kv_transfer, self.layout)
            assert pair is not None, "a named connector always yields both sides"
            self.connector_scheduler, self.connector_worker = pair
            self.executor.register_kv_caches(self.connector_worker)
        self.structured_output = (
            structured_output
            if structured_output is not None
            else StructuredOutputManager(self._make_grammar_backend)
        )
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.max_model_len,
            connector=self.connector_scheduler,
            structured_output=self.structured_output,
            speculative=config.speculative,
            max_concurrent_batches=self.executor.max_concurrent_batches,
        )
        #: where the prefix cache's changes go (``None``: KV events off)
        self.kv_event_publisher: KVEventPublisher | None = create_kv_event_publisher(
            config.kv_events, self.kv_events_medium
        )
        if self.kv_event_publisher is not None:
            self.scheduler.kv_cache_manager.enable_kv_cache_events(self.kv_events_medium)
        # Batches submitted and not yet applied, oldest first (the batch queue).
        self._batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] = deque()
        self.max_num_batches_in_flight = 0
        #: What a request must fit here (the router and services check the same rules).
        self.limits: RequestLimits = dataclasses.replace(
            self.scheduler.limits, vocab_size=self.vocab_size
        )
        self.num_steps = 0
        lock = config.parallel.shared_cpu_lock
        #: the host's shared step turn (``None``: this engine has its cores to itself)
        self.cpu_turns = CpuTurns(lock) if lock is not None else None
        spec = config.speculative
        logger.info(
            "engine ready: model=%s dtype=%s weights=%.1f MB kv_cache_dtype=%s blocks=%d (%d "
            "tokens, %d KV bytes per token) max_model_len=%d%s",
            self.layout.model_id,
            self.model_facts.dtype,
            self.model_facts.weight_bytes / 1e6,
            self.layout.dtype,
            num_blocks,
            num_blocks * config.cache.block_size,
            self.kv_cache_bytes_per_token,
            self.max_model_len,
            "" if spec is None else f" speculative={spec.method} k={spec.num_speculative_tokens}",
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (``None`` when the model has none)."""
        return self.executor.tokenizer

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """KV cache bytes one token takes across all layers (this engine's layout: what
        the store moves per token; half for an FP8 cache of a 16-bit model)."""
        layout = self.layout
        return layout.block_bytes // layout.block_size

    @property
    def layout(self) -> KVCacheLayout:
        """Layout of this engine's KV blocks (for the KV store's key fingerprint)."""
        f = self.model_facts
        return KVCacheLayout.of_spec(
            f.kv_spec,
            model_id=f.model_id,
            num_layers=f.num_layers,
            dtype=f.cache_dtype,
            block_size=self.config.cache.block_size,
            kv_scales=f.kv_scales,
        )

    def _make_grammar_backend(self) -> XgrammarBackend:
        """The xgrammar backend over this model's tokenizer (first constrained request).

        Raises:
            RequestError: naming ``structured_outputs`` when the model has no tokenizer.
        """
        from tandem.engine.structured_output.backend import XgrammarBackend

        if self.tokenizer is None:
            raise RequestError(
                "structured_outputs", "structured_outputs: this model has no tokenizer"
            )
        return XgrammarBackend.from_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_id)

    # -- requests ------------------------------------------------------------------------------

    def check_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile a constraint now (or find it cached), blocking the caller only; any
        thread may call it (the services do, before queueing a request; the offline
        ``LLMEngine`` too). The engine's own compile of the request is then a cache hit.

        Raises:
            RequestError: naming the field: the grammar library's message, or a compile
                longer than the manager's ``compile_timeout_s``.
            GrammarCompilerBusyError: the compiler has too much queued.
        """
        self.structured_output.validate(params)

    def validate_request(self, request: Request) -> None:
        """Check a request against this engine's limits; allocate nothing.

        Raises:
            ValueError: naming the field: a rule of ``engine.validation.validate_request``
                against :attr:`limits` (a ``KVCapacityError`` when the prompt can never
                fit in the KV cache), a non-zero ``priority`` under the FCFS policy
                (``check_priority``), or a request id already in the engine.
        """
        validate_request(request.prompt_token_ids, request.sampling_params, self.limits)
        check_priority(request.priority, self.config.scheduler.policy)
        self.scheduler.check_request_id(request.request_id)

    def add_request(self, request: Request) -> None:
        """Validate and queue a request.

        A request without ``max_tokens`` may generate up to ``max_model_len`` minus
        its prompt; a larger ``max_tokens`` is capped there (finish reason
        "length"), as vLLM does.

        Raises:
            ValueError: see ``validate_request``; nothing is allocated then.
        """
        self.validate_request(request)
        if request.sampling_params.max_tokens is None:
            # NOTE: a copy: the caller's SamplingParams may be shared by requests.
            request.sampling_params = dataclasses.replace(
                request.sampling_params,
                max_tokens=self.max_model_len - len(request.prompt_token_ids),
            )
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        self.scheduler.add_request(request)

    def prefetch_kv(self, request: Request) -> None:
        """Start the KV connector's lookups for a request about to be added (any thread;
        never blocks): see ``KVConnectorScheduler.prefetch``. A caller that then does
        not add it calls ``drop_prefetch_kv``."""
        # A request asking for prompt logprobs recomputes its prompt: nothing to look up.
        if self.connector_scheduler is not None and request.sampling_params.prompt_logprobs is None:
            self.connector_scheduler.prefetch(request)

    def drop_prefetch_kv(self, request: Request) -> None:
        """Undo ``prefetch_kv`` for a request that was not added (engine thread)."""
        if self.connector_scheduler is not None and request.sampling_params.prompt_logprobs is None:
            self.connector_scheduler.drop_prefetch(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests in any state; their blocks are freed at once, or, for a request
        in a batch in flight, once that batch is applied. Unknown ids are ignored."""
        self.scheduler.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches ``step`` keeps in flight: the executor's ``max_concurrent_batches``
        unless lowered (1: one batch at a time)."""
        return self.scheduler.max_concurrent_batches

    @max_concurrent_batches.setter
    def max_concurrent_batches(self, value: int) -> None:
        """Raises: ValueError naming ``max_concurrent_batches`` outside
        ``[1, executor.max_concurrent_batches]``; RuntimeError with batches in flight."""
        limit = self.executor.max_concurrent_batches
        if not 1 <= value <= limit:
            raise ValueError(f"max_concurrent_batches must be in [1, {limit}], got {value}")
        if self._batch_queue:
            raise RuntimeError("max_concurrent_batches: batches are in flight")
        self.scheduler.max_concurrent_batches = value

    @property
    def num_batches_in_flight(self) -> int:
        """Batches submitted to the executor and not yet applied."""
        return len(self._batch_queue)

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine iteration.

        Returns:
            One ``EngineCoreOutput`` per request that produced a token or finished
            this step (possibly empty, e.g. while waiting for remote KV, or when it
            only submitted a batch).
        """
        if self._batch_queue or self.scheduler.max_concurrent_batches > 1:
            return self._step_with_batch_queue()
        sched_out = self.scheduler.schedule()
        worker = self.connector_worker
        meta = sched_out.kv_connector_metadata
        if worker is not None and meta is not None:
            worker.start_load_kv(meta)
        if sched_out.is_empty:
            runner_out = ModelRunnerOutput()
        else:
            with self.cpu_turns.turn() if self.cpu_turns is not None else nullcontext():
                runner_out = self.executor.execute_model(sched_out)
            self.num_steps += 1
        return self._apply(sched_out, runner_out)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """``step`` with batches in flight (the module docstring; vLLM v1's
        ``step_with_batch_queue``)."""
        queue = self._batch_queue
        worker = self.connector_worker
        if len(queue) < self.scheduler.max_concurrent_batches:
            sched_out = self.scheduler.schedule()
            meta = sched_out.kv_connector_metadata
            if worker is not None and meta is not None:
                # Loads target free blocks, which no batch in flight holds (the scheduler
                # frees a request's blocks only after its batch was applied).
                worker.start_load_kv(meta)
            if not sched_out.is_empty:
                queue.append((self.executor.submit_step(sched_out), sched_out))
                self.num_steps += 1
                self.max_num_batches_in_flight = max(self.max_num_batches_in_flight, len(queue))
                return []
            if not queue:
                return self._apply(sched_out, ModelRunnerOutput())
            if worker is not None and meta is not None:
                # Saves of requests finished before: their batches were applied.
                worker.save_kv(meta)
        future, sched_out = queue.popleft()
        return self._apply(sched_out, future.result())

    def _apply(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """The end of a step whose batch completed: the connector's saves and finished
        transfers, then the scheduler's ``update_from_output``."""
        worker = self.connector_worker
        finished_sending: Any = set()
        finished_recving: Any = {}
        if worker is not None:
            meta = sched_out.kv_connector_metadata
            if meta is not None:
                worker.save_kv(meta)
            finished_sending, finished_recving = worker.get_finished()
        outputs = self.scheduler.update_from_output(
            sched_out, runner_out, finished_recving, finished_sending
        )
        self._publish_kv_events()
        return outputs

    @property
    def kv_events_medium(self) -> str:
        """The medium this engine's KV events name: "cpu" or "gpu" (its cache's device)."""
        return "cpu" if self.model_facts.device.startswith("cpu") else "gpu"

    def _publish_kv_events(self) -> None:
        if self.kv_event_publisher is not None:
            events = self.scheduler.kv_cache_manager.take_events()
            if events:
                self.kv_event_publisher.publish(events)

    def publish_kv_snapshot(self) -> None:
        """Publish the prefix cache's whole set of block hashes (after the events not yet
        published); nothing when KV events are off. Engine thread only; O(cached blocks)."""
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
            self.kv_event_publisher.publish_snapshot(
                self.scheduler.kv_cache_manager.cached_block_hashes()
            )

    def get_stats(self) -> Any:
        """The scheduler's ``SchedulerStats`` (queues, KV usage, prefix-cache counters)."""
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Abort every request (freeing its blocks), stop the connector's worker side, then
        shut the executor down (its workers release the KV cache). Call it once, last."""
        self.abort_requests(list(self.scheduler.requests))
        while self._batch_queue:
            future, sched_out = self._batch_queue.popleft()
            try:
                self._apply(sched_out, future.result())  # frees the aborted requests' blocks
            except Exception:  # noqa: BLE001 - a dead executor: nothing left to free
                logger.exception("a batch in flight failed at shutdown")
                self._batch_queue.clear()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
            self.kv_event_publisher.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.cpu_turns is not None:
            self.cpu_turns.close()
