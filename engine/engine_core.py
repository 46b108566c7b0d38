"""Token-in, token-out engine: the loop every tandem service drives.

One ``EngineCore`` owns an executor (the workers that hold the weights and the
paged KV cache: ``engine/executor/``), a scheduler (queues, blocks, prefix cache)
and, in disaggregated roles, both sides of a KV connector. It reaches the model
only through the executor's interface. ``step()`` runs one iteration of continuous
batching (vLLM v1's ``EngineCore.step``):

    schedule -> connector.start_load_kv -> executor.execute_model (skipped when
    nothing is scheduled) -> connector.save_kv -> connector.get_finished ->
    update_from_output

The engine is single-threaded: callers serialize ``add_request`` / ``abort_requests``
/ ``step`` (the services run it in one dedicated thread).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import EngineConfig
from tandem.engine.executor import Executor, create_executor
from tandem.engine.model_facts import ModelFacts
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.engine.sched_output import ModelRunnerOutput
from tandem.engine.structured_output.manager import StructuredOutputManager
from tandem.engine.validation import RequestError, RequestLimits, validate_request

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
        )
        #: What a request must fit here (the router and services check the same rules).
        self.limits: RequestLimits = dataclasses.replace(
            self.scheduler.limits, vocab_size=self.vocab_size
        )
        self.num_steps = 0
        spec = config.speculative
        logger.info(
            "engine ready: model=%s dtype=%s blocks=%d (%d tokens) max_model_len=%d%s",
            self.layout.model_id,
            self.layout.dtype,
            num_blocks,
            num_blocks * config.cache.block_size,
            self.max_model_len,
            "" if spec is None
            else f" speculative={spec.method} k={spec.num_speculative_tokens}",
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (``None`` when the model has none)."""
        return self.executor.tokenizer

    @property
    def layout(self) -> KVCacheLayout:
        """Layout of this engine's KV blocks (for the KV store's key fingerprint)."""
        f = self.model_facts
        return KVCacheLayout(
            model_id=f.model_id,
            num_layers=f.num_layers,
            num_kv_heads=f.num_kv_heads,
            head_dim=f.head_dim,
            dtype=f.dtype,
            block_size=self.config.cache.block_size,
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
                fit in the KV cache), or a request id already in the engine.
        """
        validate_request(request.prompt_token_ids, request.sampling_params, self.limits)
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

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests in any state; their blocks are freed at once. Unknown ids are ignored."""
        self.scheduler.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine iteration.

        Returns:
            One ``EngineCoreOutput`` per request that produced a token or finished
            this step (possibly empty, e.g. while waiting for remote KV).
        """
        sched_out = self.scheduler.schedule()
        worker = self.connector_worker
        meta = sched_out.kv_connector_metadata
        if worker is not None and meta is not None:
            worker.start_load_kv(meta)
        if sched_out.is_empty:
            runner_out = ModelRunnerOutput()
        else:
            runner_out = self.executor.execute_model(sched_out)
            self.num_steps += 1
        finished_sending: Any = set()
        finished_recving: Any = {}
        if worker is not None:
            if meta is not None:
                worker.save_kv(meta)
            finished_sending, finished_recving = worker.get_finished()
        return self.scheduler.update_from_output(
            sched_out, runner_out, finished_recving, finished_sending
        )

    def get_stats(self) -> Any:
        """The scheduler's ``SchedulerStats`` (queues, KV usage, prefix-cache counters)."""
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        """Abort every request (freeing its blocks), stop the connector's worker side, then
        shut the executor down (its workers release the KV cache). Call it once, last."""
        self.abort_requests(list(self.scheduler.requests))
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        self.structured_output.shutdown()
        self.executor.shutdown()
