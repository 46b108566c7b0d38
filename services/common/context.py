"""What the servicers of one engine instance share: the engine loop and its facts.

``ServiceContext`` turns protobuf requests into validated engine ``Request``s
(so the servicers stay a few lines each), reports load, and receives the KV
connector's transfer events (publish finished on the prefill side, load
finished on the decode side) from the connector's threads. It knows the
connector only through the engine's interface (``KVConnectorWorker``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tandem.contracts.block_hash import HASH_ALGORITHM
from tandem.contracts.proto import sampling_params_from_proto
from tandem.contracts.role import Role
from tandem.contracts.tracing import TRACING_OFF, Tracing
from tandem.engine.config import EngineConfig
from tandem.engine.kv_connector import KVConnectorWorker, LoadResult, SaveResult
from tandem.engine.request import Request
from tandem.engine.validation import RequestLimits, check_priority, validate_request
from tandem.services.common.engine_loop import EngineLoop
from tandem.services.common.errors import CapacityError
from tandem.services.common.metrics import ServiceMetrics
from tandem.v1 import common_pb2


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def _ignore_save(result: SaveResult) -> None:
    """The ``on_save`` of a role that counts no publishes."""


class TransferEvents:
    """Thread-safe mailbox between the KV connector's threads and the RPC handlers
    (a ``TransferListener``).

    The connector calls :meth:`on_save_done` / :meth:`on_load_done` from its own
    threads; handlers await :meth:`expect_save` (before the request enters the engine)
    or read :meth:`pop_load`. A load result that arrives before its handler asks is kept
    until asked for (or discarded by :meth:`forget`); a save result nobody expects is
    only passed to ``on_save``.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_event: Callable[[], None] = lambda: None,
        on_save: Callable[[SaveResult], None] = _ignore_save,
    ) -> None:
        self._loop = loop
        self._on_event = on_event
        self._on_save = on_save
        self._lock = threading.Lock()
        self._save_waiters: dict[str, asyncio.Future[SaveResult]] = {}
        self._loads: dict[str, LoadResult] = {}

    # connector threads ------------------------------------------------------------------------
    def on_save_done(self, request_id: str, result: SaveResult) -> None:
        """A request's blocks are published (or failed to be: ``result.ok``)."""
        self._on_event()  # the engine collects it and frees the blocks
        self._on_save(result)
        with self._lock:
            waiter = self._save_waiters.pop(request_id, None)
        # NOTE: a save nobody awaits (a decode's output publish, or a handler already
        # gone) is dropped: keeping it would grow without bound.
        if waiter is not None:
            self._loop.call_soon_threadsafe(_resolve, waiter, result)

    def on_load_done(self, request_id: str, result: LoadResult) -> None:
        """A request's remote blocks are loaded (``result.num_tokens`` of them)."""
        with self._lock:
            self._loads[request_id] = result
        self._on_event()  # the engine schedules the request now

    def on_lookup_done(self, request_id: str) -> None:
        """A waiting request's store lookup answered: the engine can admit it now."""
        self._on_event()

    # event loop ---------------------------------------------------------------------------
    def expect_save(self, request_id: str) -> asyncio.Future[SaveResult]:
        """A future resolved with the request's save result."""
        future: asyncio.Future[SaveResult] = self._loop.create_future()
        with self._lock:
            self._save_waiters[request_id] = future
        return future

    def pop_load(self, request_id: str) -> LoadResult | None:
        """The request's load result, if its load finished."""
        with self._lock:
            return self._loads.pop(request_id, None)

    def pending_loads(self) -> int:
        """The number of load results not yet taken (by :meth:`pop_load` or :meth:`forget`)."""
        with self._lock:
            return len(self._loads)

    def forget(self, request_id: str) -> None:
        """Drop everything about a request (its handler is gone)."""
        with self._lock:
            self._save_waiters.pop(request_id, None)
            self._loads.pop(request_id, None)


def _resolve(future: asyncio.Future[SaveResult], result: SaveResult) -> None:
    if not future.done():
        future.set_result(result)


class ServiceContext:
    """Facts and helpers of one engine instance.

    Args:
        role: what this instance does (``Role``; its value string is accepted).
        engine_loop: the engine thread bridge (its ``engine`` is an ``EngineCore``).
        config: the engine's frozen config.
        max_waiting: queued requests beyond which new ones get RESOURCE_EXHAUSTED.
    """

    def __init__(
        self, role: Role | str, engine_loop: EngineLoop, config: EngineConfig, max_waiting: int = 1024
    ) -> None:
        engine = engine_loop.engine
        facts = engine.model_facts
        self.role = Role.parse(role)
        self.engine_loop = engine_loop
        self.config = config
        self.max_waiting = max_waiting
        self.block_size = config.cache.block_size
        self.vocab_size: int = facts.vocab_size
        self.max_model_len: int = facts.max_model_len
        # Context length capped by the KV cache's capacity (the scheduler's limit).
        self.max_seq_len: int = engine.scheduler.max_seq_len
        self.limits: RequestLimits = engine.limits
        self.eos_token_id: int | None = facts.eos_token_id
        self.model_id: str = facts.model_id
        # NOTE: reported in GetLoad and the registry: the router validates requests against
        # what its engines serve instead of reading the model's files itself.
        self.architecture: str = facts.architecture
        self.model_impl: str = facts.model_impl
        self.kv_layout_fingerprint: bytes = engine.layout.fingerprint
        self.hash_algorithm = HASH_ALGORITHM
        # NOTE: what GetLoad tells the router: it then hints a chat's next turn to wait
        # for this instance's output publishes (contracts.block_key.PublishInFlight).
        self.kv_publish_output: bool = (
            self.role == Role.DECODE
            and bool(getattr(config.kv_transfer.connector_config, "publish_output", False)))
        self.metrics = ServiceMetrics(self.role)
        self.metrics.labels(self.metrics.kv_cache_bytes_per_token).set(
            engine.kv_cache_bytes_per_token)
        self.metrics.labels(self.metrics.kv_cache_capacity_tokens).set(
            engine.num_blocks * self.block_size)
        self.metrics.labels(self.metrics.model_weight_bytes).set(facts.weight_bytes)
        self.transfers: TransferEvents | None = None
        self._connector: KVConnectorWorker | None = engine.connector_worker
        #: the process's OpenTelemetry tracing (``contracts/tracing.py``): off
        #: unless the entry point starts it
        self.tracing: Tracing = TRACING_OFF

    def attach_connector_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """Route the KV connector's transfer events to :attr:`transfers` (no-op without one)."""
        if self._connector is None:
            return
        on_save: Callable[[SaveResult], None] = _ignore_save
        if self.role == Role.DECODE:
            metrics = self.metrics

            def count_publish(result: SaveResult) -> None:
                outcome = "ok" if result.ok else "failed"
                metrics.labels(metrics.kv_output_publishes, outcome=outcome).inc()

            on_save = count_publish
        self.transfers = TransferEvents(loop, self.engine_loop.wake, on_save)
        self._connector.set_listener(self.transfers)

    @property
    def has_store(self) -> bool:
        """Whether this instance has a KV connector (disaggregated roles)."""
        return self._connector is not None

    def close(self) -> None:
        """Stop the connector's transfer threads (after the engine loop stopped)."""
        if self._connector is not None:
            self._connector.shutdown()

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params_msg: common_pb2.SamplingParams,
        priority: int,
    ) -> Request:
        """Validate a protobuf request's fields and build the engine ``Request``.

        The rules are the engine's (``engine.validation.validate_request`` against
        ``EngineCore.limits``), checked here so that a bad request is rejected before it
        reaches the engine thread.

        Raises:
            ValueError: naming the field: a bad sampling parameter, an empty prompt, token
                ids outside the vocabulary, a prompt that leaves no room in the context, a
                non-zero ``priority`` on an FCFS engine.
            KVCapacityError: the prompt can never fit in this instance's KV cache.
            CapacityError: the queue is full.
        """
        prompt = list(prompt_token_ids)
        params = sampling_params_from_proto(params_msg)
        validate_request(prompt, params, self.limits)
        check_priority(priority, self.config.scheduler.policy)
        if self.engine_loop.num_in_flight >= self.max_waiting + self.config.scheduler.max_num_seqs:
            raise CapacityError(
                f"instance overloaded: {self.engine_loop.num_in_flight} requests in flight"
            )
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=prompt,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            priority=priority,
        )

    async def check_structured_outputs(self, request: Request) -> None:
        """Compile the request's constraint (if any) on a worker thread before it is
        queued, so a bad schema, regex or grammar is rejected by the RPC itself; the
        engine's own compile is then a cache hit. The engine thread is not involved.

        Raises:
            RequestError: naming ``structured_outputs.<kind>`` with the library's message,
                or a compile longer than the engine's time limit (INVALID_ARGUMENT).
            GrammarCompilerBusyError: the compile could not start in time
                (RESOURCE_EXHAUSTED).
        """
        so = request.sampling_params.structured_outputs
        if so is None:
            return
        engine = self.engine_loop.engine
        await asyncio.to_thread(engine.check_structured_outputs, so)

    async def stats(self) -> Any:
        """The scheduler's ``SchedulerStats`` (read in the engine thread; the last
        snapshot while a long step runs, see ``EngineLoop.stats``)."""
        return await self.engine_loop.stats()

    async def load_response(self) -> common_pb2.GetLoadResponse:
        """``GetLoadResponse`` of this instance (also refreshes the Prometheus gauges and
        counters, so that ``/metrics`` read after a ``GetLoad`` is current)."""
        s = await self.stats()
        self._observe(s)
        queries = getattr(s, "prefix_cache_queries", 0)
        hits = getattr(s, "prefix_cache_hits", 0)
        return common_pb2.GetLoadResponse(
            num_running_requests=s.num_running,
            num_waiting_requests=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_free_blocks=s.num_free_blocks,
            num_total_blocks=s.num_total_blocks,
            prefix_cache_hit_rate=hits / queries if queries else 0.0,
            role=self.role,
            model=self.model_id,
            block_size=self.block_size,
            kv_layout_fingerprint=self.kv_layout_fingerprint,
            num_kv_load_failures=self.num_kv_load_failures,
            kv_publish_output=self.kv_publish_output,
            max_model_len_tokens=self.max_model_len,
            vocab_size_tokens=self.vocab_size,
            architecture=self.architecture,
            model_impl=self.model_impl,
        )

    def _observe(self, stats: Any) -> None:
        conn = self._connector
        waiting = 0 if conn is None else conn.num_loads_waiting
        lookup_waits = None if conn is None else conn.lookup_waits
        turns = getattr(self.engine_loop.engine, "cpu_turns", None)
        self.metrics.observe_stats(stats, self.num_kv_load_failures, waiting, lookup_waits,
                                   0.0 if turns is None else turns.wait_seconds)

    @property
    def num_kv_load_failures(self) -> int:
        return 0 if self._connector is None else self._connector.num_load_failures

    def registry_facts(self) -> dict[str, str | int]:
        """The model's facts in the Redis registry entry (names as in ``GetLoadResponse``),
        so the router knows an instance's limits from its registration, before a poll."""
        return {
            "max_model_len_tokens": self.max_model_len,
            "vocab_size_tokens": self.vocab_size,
            "architecture": self.architecture,
            "model_impl": self.model_impl,
        }

    async def registry_load(self) -> dict[str, float | int | str]:
        """Fields of the Redis registry entry: the load (also refreshes the Prometheus
        gauges) and :meth:`registry_facts`."""
        s = await self.stats()
        self._observe(s)
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_usage": s.kv_cache_usage,
            "num_free_blocks": s.num_free_blocks,
            **self.registry_facts(),
        }


def now_ns() -> int:
    """Monotonic clock in ns (the clock of every ``*_ns`` duration)."""
    return time.monotonic_ns()
