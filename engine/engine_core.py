"""Token-in, token-out engine: the loop every tandem service drives.

One ``EngineCore`` owns a model runner (weights + paged KV cache), a scheduler
(queues, blocks, prefix cache) and, in disaggregated roles, both sides of a KV
connector. ``step()`` runs one iteration of continuous batching (vLLM v1's
``EngineCore.step``):

    schedule -> connector.start_load_kv -> execute_model (skipped when nothing is
    scheduled) -> connector.save_kv -> connector.get_finished -> update_from_output

The engine is single-threaded: callers serialize ``add_request`` / ``abort_requests``
/ ``step`` (the services run it in one dedicated thread).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.engine.config import EngineConfig
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.engine.sched_output import ModelRunnerOutput
from tandem.engine.validation import RequestLimits, validate_request
from tandem.kvstore.keys import LayoutFingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheLayout:
    """What a KV block's bytes mean; two engines may share blocks only if equal.

    Attributes:
        model_id: the loaded model's identifier (path or name).
        num_layers: transformer layers (each block holds all of them).
        num_kv_heads: KV heads per layer.
        head_dim: size of one head.
        dtype: torch dtype name of the cache, e.g. "bfloat16".
        block_size: tokens per block.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one block (K and V of every layer)."""
        return LayoutFingerprint.from_layout(self).block_bytes

    @property
    def fingerprint(self) -> bytes:
        """The KV store's layout fingerprint of this layout (``LayoutFingerprint.digest``:
        16 bytes of SHA-256 over the fields, stable across machines): one definition,
        so that engines and store keys can never disagree."""
        return LayoutFingerprint.from_layout(self).digest


class EngineCore:
    """Continuous-batching engine over token ids.

    Args:
        config: the engine's frozen configuration.
        loaded: an already loaded model (``model_loader.load_model``) to reuse, e.g.
            in tests that build several engines; ``None`` loads ``config.model``.

    Raises:
        ValueError: unknown model path or unsupported architecture (from the loader).
    """

    def __init__(self, config: EngineConfig, loaded: Any | None = None) -> None:
        from tandem.engine.model_runner import ModelRunner
        from tandem.engine.scheduler import Scheduler

        self.config = config
        self.model_runner = ModelRunner(config, loaded)
        runner = self.model_runner
        if config.cache.num_blocks_override is not None:
            num_blocks = config.cache.num_blocks_override
        else:
            num_blocks = runner.determine_num_blocks()
        runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        self.max_model_len: int = runner.max_model_len
        self.vocab_size: int = runner.vocab_size
        self.eos_token_id: int | None = runner.eos_token_id

        self.connector_scheduler: Any = None
        self.connector_worker: Any = None
        if config.kv_transfer.kv_connector is not None:
            from tandem.engine.kv_connector import create_connector

            self.connector_scheduler, self.connector_worker = create_connector(
                config.kv_transfer, self.layout
            )
            self.connector_worker.register_kv_caches(runner.kv_cache)
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            self.max_model_len,
            connector=self.connector_scheduler,
        )
        #: What a request must fit here (the router and services check the same rules).
        self.limits: RequestLimits = dataclasses.replace(
            self.scheduler.limits, vocab_size=self.vocab_size
        )
        self.num_steps = 0
        logger.info(
            "engine ready: model=%s dtype=%s blocks=%d (%d tokens) max_model_len=%d",
            self.layout.model_id,
            self.layout.dtype,
            num_blocks,
            num_blocks * config.cache.block_size,
            self.max_model_len,
        )

    # -- properties ----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""
        return self.model_runner.loaded.tokenizer

    @property
    def layout(self) -> KVCacheLayout:
        """Layout of this engine's KV blocks (for the KV store's key fingerprint)."""
        r = self.model_runner
        return KVCacheLayout(
            model_id=str(r.loaded.model_id),
            num_layers=int(r.num_layers),
            num_kv_heads=int(r.num_kv_heads),
            head_dim=int(r.head_dim),
            dtype=str(r.dtype).removeprefix("torch."),
            block_size=self.config.cache.block_size,
        )

    # -- requests ------------------------------------------------------------------------------

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
            runner_out = self.model_runner.execute_model(sched_out)
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
        """Abort every request (freeing its blocks) and stop the connector's worker side."""
        self.abort_requests(list(self.scheduler.requests))
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
