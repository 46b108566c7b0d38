"""The seam between the engine and a KV block store (vLLM v1 ``kv_connector/v1/base.py`` split).

A connector has two halves that run in different places of the engine:

* ``KVConnectorScheduler`` lives in the scheduler. It answers "how many of this
  request's tokens can be loaded from remote KV?", records which blocks to load
  after the scheduler allocated them, and which blocks of a finished request to
  publish. Once per step it packs that work into an opaque metadata object.
* ``KVConnectorWorker`` lives next to the KV cache tensor. It starts loads and
  saves described by the metadata and reports which requests finished loading
  (with how many tokens actually arrived) or saving.

Flow per engine step (``EngineCore.step``)::

    sched_out = scheduler.schedule()          # calls the scheduler side;
                                              # sched_out.kv_connector_metadata = meta
    worker.start_load_kv(meta)                # even when the batch is empty
    runner.execute_model(sched_out)           # skipped when the batch is empty
    worker.save_kv(meta)
    sending, recving = worker.get_finished()
    scheduler.update_from_output(sched_out, out, recving, sending)

KV layout: ``kv_cache`` is ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]`` (model dtype); block ``b``'s bytes for all layers are ``kv_cache[b]``. A
tensor/pipeline-parallel engine's cache is split over its ranks instead: a
:class:`~tandem.engine.kv_shards.ShardedKVCache` that reads and writes such full blocks
(connectors store blocks in that full-head layout, so engines at any TP/PP share them).

Besides the step loop, the services watch the worker side: a
:class:`TransferListener` receives each transfer's outcome (``set_listener``),
``has_pending`` keeps the engine thread stepping while transfers are in flight,
and ``num_load_failures`` / ``num_loads_waiting`` feed the load metrics. They use only this interface,
never a concrete connector.

Implementations are picked by name through ``create_connector`` and imported
lazily, so the colocated engine never imports UCX or Redis clients: the KV
store's connector lives in ``tandem.kvstore.connector`` and is registered here
by its ``"module:function"`` name only (the engine never imports the store).
Tests register their own fakes with :func:`register_connector`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import KVTransferConfig
from tandem.engine.kv_shards import ShardedKVCache
from tandem.engine.lazy_registry import resolve
from tandem.engine.request import Request

if TYPE_CHECKING:
    from tandem.engine.sched_output import SchedulerOutput


@dataclass(frozen=True)
class SaveResult:
    """Outcome of publishing one finished request's blocks.

    Attributes:
        ok: False when the store failed (the blocks are freed anyway; a failed
            publish only makes a later load miss).
        num_blocks: blocks of the request.
        num_stored: blocks the store holds after the save (present ones are not resent).
        done_ns: ``time.monotonic_ns()`` at completion.
        error: the failure's message, ``None`` when ``ok``.
    """

    ok: bool
    num_blocks: int
    num_stored: int
    done_ns: int
    error: str | None = None


@dataclass(frozen=True)
class LoadResult:
    """Outcome of loading one request's remote blocks.

    Attributes:
        num_tokens: tokens loaded, counted from the load's first token.
        num_requested_tokens: tokens the load covered.
        done_ns: ``time.monotonic_ns()`` at completion.
        num_bytes: bytes of the blocks loaded (all layers, K and V).
        wait_outcome: when the load waited for blocks the producer was still
            publishing, how the wait ended (the connector's word, e.g. ``arrived``,
            ``deadline``); ``None`` when it did not wait.
        wait_ns: how long it waited, ns (0 when it did not).
    """

    num_tokens: int
    num_requested_tokens: int
    done_ns: int
    num_bytes: int = 0
    wait_outcome: str | None = None
    wait_ns: int = 0

    @property
    def complete(self) -> bool:
        """Every requested token arrived (nothing to recompute)."""
        return self.num_tokens == self.num_requested_tokens


class TransferListener(Protocol):
    """Receives transfer outcomes from a connector's worker side.

    Called on whatever thread finished the transfer (a connector's transfer thread,
    or the engine thread for a synchronous connector), once per transfer, after the
    outcome is visible to ``KVConnectorWorker.get_finished``. Must not block and must
    not call back into the engine. Not called for a load cancelled by an abort.
    """

    def on_save_done(self, request_id: str, result: SaveResult) -> None:
        """A finished request's blocks are published (or failed to be: ``result.ok``)."""

    def on_load_done(self, request_id: str, result: LoadResult) -> None:
        """A request's remote blocks are loaded (``result.num_tokens`` tokens of them)."""

    def on_lookup_done(self, request_id: str) -> None:
        """A waiting request's remote lookup answered (``get_num_new_matched_tokens``
        returned ``None`` for it): the engine can try to admit it now."""


class KVConnectorScheduler(ABC):
    """Scheduler side of a connector. Called only from the engine thread; never blocks
    on data transfer (a metadata lookup is acceptable)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> int | None:
        """Tokens of ``request`` available remotely beyond its local cache hit.

        Called when the scheduler tries to admit a request that holds no blocks;
        may be called again for the same request in later steps if admission
        failed, so it must not change what a later call answers (starting a
        lookup whose answer a later call returns is fine).

        Args:
            request: a waiting request (``request.all_token_ids`` is what is known).
            num_computed_tokens: tokens covered by the local prefix cache (a
                multiple of the block size).

        Returns:
            Number of tokens starting at ``num_computed_tokens`` that can be
            loaded; 0 on a miss (a miss is a value, never an exception); ``None``
            while that is not known yet (a lookup is running: the request waits
            and is asked again in a later step, after the listener's
            ``on_lookup_done``; vLLM's connectors answer the same way). The
            scheduler clamps it so that at least one token is computed locally.
        """

    def prefetch(self, request: Request) -> None:  # noqa: B027 - optional hook
        """A request is arriving (called from any thread, before the engine thread adds
        it): start the lookups ``get_num_new_matched_tokens`` will ask for, so that a
        request arriving during a step can be admitted at the next one. Must be
        thread-safe and must not block. The default does nothing."""

    def drop_prefetch(self, request: Request) -> None:  # noqa: B027 - optional hook
        """The engine did not take a prefetched request (rejected, cancelled): drop
        what ``prefetch`` started for it (called from the engine thread). The
        default does nothing."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record a load after the scheduler allocated blocks for the remote tokens.

        Called only with ``num_external_tokens > 0``. At call time
        ``request.num_computed_tokens`` is the local hit; the load targets
        token positions ``[num_computed_tokens, num_computed_tokens +
        num_external_tokens)``. ``block_ids`` is the request's whole block table
        (it already covers all of the request's tokens; token ``t`` lives in
        ``block_ids[t // block_size]``). The load starts on the worker side from
        this step's metadata. Mutates only connector state.
        """

    @abstractmethod
    def build_connector_meta(self, sched_out: SchedulerOutput) -> object | None:
        """Pack the loads and saves recorded since the last call into worker metadata.

        Called once at the end of every ``Scheduler.schedule()``, even when the
        batch is empty; resets the per-step state. ``sched_out`` is the
        ``SchedulerOutput`` being built (read only). Returns an object only this
        connector's worker side understands, or ``None`` when there is nothing to do.
        """

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """A request finished (stop, length or abort) while holding ``block_ids``.

        The connector may record a save of the request's computed KV
        (``request.all_token_ids[:request.num_computed_tokens]``: full blocks and
        the partial last block) and must drop any state of a pending load.

        Returns:
            True to make the scheduler keep the blocks allocated until the worker
            reports the request id in ``finished_sending`` (or
            ``finished_recving``, for an aborted in-flight load); False to free
            them at once.
        """


class KVConnectorWorker(ABC):
    """Worker side of a connector: moves bytes between the KV cache and the store."""

    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor | ShardedKVCache) -> None:
        """Remember the engine's KV cache: one tensor
        ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, or a
        :class:`~tandem.engine.kv_shards.ShardedKVCache` of the ranks' shards (tensor or
        pipeline parallelism) whose ``read_blocks``/``write_blocks`` move full blocks of
        that shape. Every implementation accepts both (``ShardedKVCache.from_tensor``
        makes the one-shard case of a tensor).

        Called once before the first step. Raises ValueError when the cache does not
        match the layout the connector was built for (full block shape ``layout.
        block_shape``).
        """

    @abstractmethod
    def start_load_kv(self, meta: object) -> None:
        """Start the loads in ``meta`` into their block ids. Must not block on the
        transfer; a load's result is reported later by ``get_finished``. The
        scheduler does not schedule those requests until then."""

    @abstractmethod
    def save_kv(self, meta: object) -> None:
        """Start the saves in ``meta`` (called after the step's forward). Must not block
        on the transfer; the blocks stay allocated until ``get_finished`` reports
        the request in ``finished_sending``."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], dict[str, int]]:
        """Poll finished transfers; never blocks; reports each request once.

        Returns:
            (finished_sending: request ids whose save completed (or failed: the
            blocks may be freed either way), finished_recving: request id ->
            number of tokens actually loaded, counted from the load's first
            token; fewer than requested on a miss, and the scheduler recomputes
            the rest).
        """

    @abstractmethod
    def set_listener(self, listener: TransferListener | None) -> None:
        """Send each later transfer's outcome to ``listener`` (``None``: to nobody).

        Never blocks; replaces the previous listener. Outcomes that finished before
        the call are not replayed.
        """

    @abstractmethod
    def has_pending(self) -> bool:
        """Whether transfers are in flight or finished but not yet collected by
        ``get_finished``: while True, the engine must keep stepping even with no
        request to run. Never blocks; mutates nothing."""

    @property
    @abstractmethod
    def num_load_failures(self) -> int:
        """Loads since start that delivered fewer tokens than requested (a miss, a bad
        checksum or a store error; the scheduler recomputed the rest). A load cancelled
        by an abort is not counted. Never blocks."""

    @property
    def num_loads_waiting(self) -> int:
        """Loads parked now until blocks the producer is still publishing arrive (see
        ``KVTransferParams.publish_pending``). Default 0: a connector that never waits.
        Never blocks."""
        return 0

    @property
    def lookup_waits(self) -> dict[str, int]:
        """Lookups since start that waited for blocks an earlier request was still
        publishing (``Request.kv_publish_in_flight``), by how the wait ended. Default
        empty: a connector that never waits. Never blocks."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release transfer resources (connections, threads). Default: nothing."""


ConnectorPair = tuple[KVConnectorScheduler, KVConnectorWorker]
#: ``(kv_transfer_config, layout) -> (scheduler side, worker side)``.
ConnectorFactory = Callable[[KVTransferConfig, KVCacheLayout], ConnectorPair]

#: name -> ``"module:function"`` (the module is imported only when chosen) or a factory.
_REGISTRY: dict[str, str | ConnectorFactory] = {
    "store": "tandem.kvstore.connector:create_connector",
}


def register_connector(name: str, target: str | ConnectorFactory) -> None:
    """Add or replace the connector called ``name``.

    Args:
        name: what ``KVTransferConfig.kv_connector`` says to choose it.
        target: ``"package.module:function"`` naming a :data:`ConnectorFactory`
            (imported at first use), or the factory itself.

    Raises:
        ValueError: a string target without ``":"``, or an empty name.
    """
    if not name:
        raise ValueError("name must be a non-empty string")
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    _REGISTRY[name] = target


def unregister_connector(name: str) -> None:
    """Remove the connector called ``name`` (nothing if it is not registered)."""
    _REGISTRY.pop(name, None)


def create_connector(
    kv_transfer_config: KVTransferConfig, layout: KVCacheLayout
) -> ConnectorPair | None:
    """Build both sides of the configured connector.

    Args:
        kv_transfer_config: ``kv_connector`` names the implementation (``None``
            means colocated mode: no connector); ``kv_role`` and
            ``connector_config`` are passed through to its factory.
        layout: the engine's KV layout; implementations use it for the block-key
            fingerprint and shape checks.

    Returns:
        (scheduler side, worker side), or ``None`` when ``kv_connector`` is None.

    Raises:
        ValueError: unknown connector name (the message lists the known ones), or the
            factory's own ValueError (a missing or mistyped ``connector_config``).
        ImportError: the implementation's module failed to import (not swallowed).
    """
    name = kv_transfer_config.kv_connector
    if name is None:
        return None
    factory: ConnectorFactory = resolve(_REGISTRY, name, "kv_connector")
    return factory(kv_transfer_config, layout)
