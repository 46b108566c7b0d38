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
head_dim]`` (model dtype); block ``b``'s bytes for all layers are ``kv_cache[b]``.

Implementations are picked by name through ``create_connector`` and imported
lazily, so the colocated engine never imports UCX or Redis clients. This module
also holds the in-process ``"memory"`` connector (a dict of block hash ->
tensor) used by tests of the scheduler's remote-KV path.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.engine.block_hash import BlockHash, hash_token_blocks
from tandem.engine.config import KVTransferConfig
from tandem.engine.request import Request, RequestStatus


class KVConnectorScheduler(ABC):
    """Scheduler side of a connector. Called only from the engine thread; never blocks
    on data transfer (a metadata lookup is acceptable)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of ``request`` available remotely beyond its local cache hit.

        Called when the scheduler tries to admit a request that holds no blocks;
        may be called again for the same request in later steps if admission
        failed, so it must be free of side effects.

        Args:
            request: a waiting request (``request.all_token_ids`` is what is known).
            num_computed_tokens: tokens covered by the local prefix cache (a
                multiple of the block size).

        Returns:
            Number of tokens starting at ``num_computed_tokens`` that can be
            loaded; 0 on a miss (a miss is a value, never an exception). The
            scheduler clamps it so that at least one token is computed locally.
        """

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
    def build_connector_meta(self, sched_out: Any) -> Any:
        """Pack the loads and saves recorded since the last call into worker metadata.

        Called once at the end of every ``Scheduler.schedule()``, even when the
        batch is empty; resets the per-step state. ``sched_out`` is the
        ``SchedulerOutput`` being built. Returns an opaque object (``None`` if
        there is nothing to do is fine).
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
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        """Remember the engine's KV cache tensor
        ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.

        Called once before the first step. Raises ValueError when the tensor does
        not match the layout the connector was built for.
        """

    @abstractmethod
    def start_load_kv(self, meta: Any) -> None:
        """Start the loads in ``meta`` into their block ids. Must not block on the
        transfer; a load's result is reported later by ``get_finished``. The
        scheduler does not schedule those requests until then."""

    @abstractmethod
    def save_kv(self, meta: Any) -> None:
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

    def shutdown(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Release transfer resources (connections, threads). Default: nothing."""


ConnectorPair = tuple[KVConnectorScheduler, KVConnectorWorker]
ConnectorFactory = Callable[[KVTransferConfig, Any], ConnectorPair]

#: name -> "module:function". The function is ``(kv_transfer_config, layout) ->
#: (scheduler_side, worker_side)``; the module is imported only when chosen.
_REGISTRY: dict[str, str] = {
    "memory": "tandem.engine.kv_connector:create_memory_connector",
    "store": "tandem.engine.kv_connector_store:create_connector",
}


def register_connector(name: str, target: str) -> None:
    """Add or replace a connector: ``target`` is ``"package.module:function"``."""
    if ":" not in target:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    _REGISTRY[name] = target


def create_connector(kv_transfer_config: KVTransferConfig, layout: Any) -> ConnectorPair | None:
    """Build both sides of the configured connector.

    Args:
        kv_transfer_config: ``kv_connector`` names the implementation (``None``
            means colocated mode: no connector); ``kv_role`` and ``params`` are
            passed through.
        layout: the engine's KV layout description (model id, layers, KV heads,
            head dim, dtype, block size), opaque here; implementations use it for
            the block-key fingerprint and shape checks.

    Returns:
        (scheduler side, worker side), or ``None`` when ``kv_connector`` is None.

    Raises:
        ValueError: unknown connector name (the message lists the known ones).
        ImportError: the implementation's module failed to import (not swallowed).
    """
    name = kv_transfer_config.kv_connector
    if name is None:
        return None
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"kv_connector must be one of {sorted(_REGISTRY)}, got {name!r}")
    module_name, func_name = target.split(":")
    factory: ConnectorFactory = getattr(importlib.import_module(module_name), func_name)
    return factory(kv_transfer_config, layout)


# --------------------------------------------------------------------------------------
# In-process "memory" connector
# --------------------------------------------------------------------------------------


class MemoryKVStore:
    """A dict of block hash -> block tensor (``kv_cache[b]`` copies), shared by engines
    in one process. Pass it as ``KVTransferConfig.params["store"]`` to share it; a
    test causes a real miss with ``evict``."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, torch.Tensor] = {}

    def put(self, block_hash: BlockHash, block: torch.Tensor) -> None:
        self.blocks[block_hash] = block.detach().clone()

    def get(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block, or ``None`` on a miss."""
        return self.blocks.get(block_hash)

    def evict(self, block_hash: BlockHash) -> bool:
        """Drop a block; True if it was there."""
        return self.blocks.pop(block_hash, None) is not None

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class BlockTransfer:
    """One request's load or save: parallel lists, one entry per block.

    Attributes:
        block_hashes: store keys (chain hashes; the last may be a partial block's).
        block_ids: KV cache blocks to read from (save) or write into (load).
        num_tokens: tokens of the transfer that each block holds.
    """

    block_hashes: list[BlockHash]
    block_ids: list[int]
    num_tokens: list[int]


@dataclass
class MemoryConnectorMetadata:
    """Work for the memory worker for one step: request id -> transfer."""

    loads: dict[str, BlockTransfer] = field(default_factory=dict)
    saves: dict[str, BlockTransfer] = field(default_factory=dict)


def _prompt_chain(request: Request, block_size: int) -> list[BlockHash]:
    # The remote KV a producer published covers the prompt (full blocks plus the
    # partial tail); a consumer's request also holds the first sampled token.
    return hash_token_blocks(request.prompt_token_ids, block_size, include_partial=True)


class MemoryConnectorScheduler(KVConnectorScheduler):
    """Scheduler side of the memory connector.

    Producer role (``kv_producer``/``kv_both``): publishes every finished,
    non-aborted request's computed blocks (full ones and the partial tail).
    Consumer role (``kv_consumer``/``kv_both``): loads the longest run of the
    prompt's blocks present in the store.
    """

    def __init__(self, store: MemoryKVStore, block_size: int, kv_role: str) -> None:
        self.store = store
        self.block_size = block_size
        self.is_producer = kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_role in ("kv_consumer", "kv_both")
        self._loads: dict[str, BlockTransfer] = {}
        self._saves: dict[str, BlockTransfer] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.is_consumer:
            return 0
        bs = self.block_size
        chain = _prompt_chain(request, bs)
        end = num_computed_tokens // bs
        while end < len(chain) and chain[end] in self.store:
            end += 1
        matched_end = min(end * bs, request.num_prompt_tokens)
        return max(0, matched_end - num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        bs = self.block_size
        start = request.num_computed_tokens
        stop = start + num_external_tokens
        chain = _prompt_chain(request, bs)
        first, last = start // bs, -(-stop // bs)
        assert last <= len(chain), f"{request.request_id}: load past the prompt"
        self._loads[request.request_id] = BlockTransfer(
            block_hashes=chain[first:last],
            block_ids=block_ids[first:last],
            num_tokens=[min((i + 1) * bs, stop) - max(i * bs, start) for i in range(first, last)],
        )

    def build_connector_meta(self, sched_out: Any) -> MemoryConnectorMetadata:
        meta = MemoryConnectorMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = {}, {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        # Loads complete inside start_load_kv (same step), so none is in flight here.
        self._loads.pop(request.request_id, None)
        if not self.is_producer or request.status == RequestStatus.FINISHED_ABORTED:
            return False
        tokens = request.all_token_ids[: request.num_computed_tokens]
        chain = hash_token_blocks(tokens, self.block_size, include_partial=True)
        if not chain:
            return False
        assert len(chain) <= len(block_ids), f"{request.request_id}: fewer blocks than KV"
        bs = self.block_size
        self._saves[request.request_id] = BlockTransfer(
            block_hashes=chain,
            block_ids=block_ids[: len(chain)],
            num_tokens=[min(bs, len(tokens) - i * bs) for i in range(len(chain))],
        )
        return True


class MemoryConnectorWorker(KVConnectorWorker):
    """Worker side of the memory connector: synchronous tensor copies.

    ``start_load_kv``/``save_kv`` complete inside the call (an in-process copy);
    results are reported by the next ``get_finished``.
    """

    def __init__(self, store: MemoryKVStore) -> None:
        self.store = store
        self.kv_cache: torch.Tensor | None = None
        self._finished_sending: set[str] = set()
        self._finished_recving: dict[str, int] = {}

    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache

    def start_load_kv(self, meta: Any) -> None:
        if not isinstance(meta, MemoryConnectorMetadata) or not meta.loads:
            return
        assert self.kv_cache is not None, "register_kv_caches was not called"
        for req_id, load in meta.loads.items():
            loaded = 0
            for block_hash, block_id, n in zip(
                load.block_hashes, load.block_ids, load.num_tokens, strict=True
            ):
                block = self.store.get(block_hash)
                if block is None:
                    break  # a miss ends the usable prefix; the rest is recomputed
                self.kv_cache[block_id].copy_(block)
                loaded += n
            self._finished_recving[req_id] = loaded

    def save_kv(self, meta: Any) -> None:
        if not isinstance(meta, MemoryConnectorMetadata) or not meta.saves:
            return
        assert self.kv_cache is not None, "register_kv_caches was not called"
        for req_id, save in meta.saves.items():
            for block_hash, block_id in zip(save.block_hashes, save.block_ids, strict=True):
                self.store.put(block_hash, self.kv_cache[block_id])
            self._finished_sending.add(req_id)

    def get_finished(self) -> tuple[set[str], dict[str, int]]:
        sending, recving = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving = set(), {}
        return sending, recving


def create_memory_connector(kv_transfer_config: KVTransferConfig, layout: Any) -> ConnectorPair:
    """Factory of the ``"memory"`` connector.

    ``params``: ``"store"`` (a ``MemoryKVStore`` to share between engines; a new
    one by default) and ``"block_size"`` (default: ``layout.block_size``).

    Raises:
        ValueError: no block size given by params or layout.
    """
    params = kv_transfer_config.params
    store = params.get("store")
    if store is None:
        store = MemoryKVStore()
    block_size = params.get("block_size", getattr(layout, "block_size", None))
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(
            "memory connector needs a block size: params['block_size'] or layout.block_size"
        )
    return (
        MemoryConnectorScheduler(store, block_size, kv_transfer_config.kv_role),
        MemoryConnectorWorker(store),
    )
