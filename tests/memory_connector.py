"""An in-process KV connector for tests: a dict of block hash -> block tensor.

Engines in one process share a :class:`MemoryKVStore` through a connector registered
for it (:func:`register_memory_connector`), so tests exercise the scheduler's and the
engine's remote-KV path through the same registry the store connector goes through.
Transfers complete synchronously inside ``start_load_kv`` / ``save_kv`` and are reported
by the next ``get_finished``.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field

import torch

from tandem.contracts.block_hash import BlockHash, hash_token_blocks, prompt_block_hashes
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import KVTransferConfig
from tandem.engine.kv_connector import (
    KVConnectorScheduler,
    KVConnectorWorker,
    LoadResult,
    SaveResult,
    TransferListener,
    register_connector,
)
from tandem.engine.kv_shards import ShardedKVCache
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched_output import SchedulerOutput

_names = itertools.count()


class MemoryKVStore:
    """A dict of block hash -> block tensor (``kv_cache[b]`` copies). A test causes a
    real miss with ``evict``."""

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
        # The remote KV a producer published covers the prompt (full blocks plus the
        # partial tail); a consumer's request also holds the first sampled token.
        chain = prompt_block_hashes(request.prompt_token_ids, bs)
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
        chain = prompt_block_hashes(request.prompt_token_ids, bs)
        first, last = start // bs, -(-stop // bs)
        assert last <= len(chain), f"{request.request_id}: load past the prompt"
        self._loads[request.request_id] = BlockTransfer(
            block_hashes=chain[first:last],
            block_ids=block_ids[first:last],
            num_tokens=[min((i + 1) * bs, stop) - max(i * bs, start) for i in range(first, last)],
        )

    def build_connector_meta(self, sched_out: SchedulerOutput) -> MemoryConnectorMetadata:
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

    ``start_load_kv``/``save_kv`` complete inside the call (an in-process copy) and
    tell the listener at once; results are reported by the next ``get_finished``.
    """

    def __init__(self, store: MemoryKVStore) -> None:
        self.store = store
        self.kv_cache: ShardedKVCache | None = None
        self._listener: TransferListener | None = None
        self._num_load_failures = 0
        self._finished_sending: set[str] = set()
        self._finished_recving: dict[str, int] = {}

    def register_kv_caches(self, kv_cache: torch.Tensor | ShardedKVCache) -> None:
        """Blocks are stored whole (full-head), so a sharded cache's too."""
        if isinstance(kv_cache, torch.Tensor):
            # dim 2: K and V, or an MLA model's one latent entry (KVCacheSpec)
            if kv_cache.dim() != 6 or kv_cache.shape[2] not in (1, 2):
                raise ValueError(
                    "kv_cache must be [num_blocks, num_layers, 2 (or 1), block_size, "
                    f"num_kv_heads, head_dim], got shape {tuple(kv_cache.shape)}"
                )
            kv_cache = ShardedKVCache.from_tensor(kv_cache)
        self.kv_cache = kv_cache

    def start_load_kv(self, meta: object) -> None:
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
                self.kv_cache.write_block(block_id, block)
                loaded += n
            requested = sum(load.num_tokens)
            self._num_load_failures += loaded < requested
            self._finished_recving[req_id] = loaded
            if self._listener is not None:
                self._listener.on_load_done(
                    req_id, LoadResult(loaded, requested, time.monotonic_ns())
                )

    def save_kv(self, meta: object) -> None:
        if not isinstance(meta, MemoryConnectorMetadata) or not meta.saves:
            return
        assert self.kv_cache is not None, "register_kv_caches was not called"
        for req_id, save in meta.saves.items():
            for block_hash, block_id in zip(save.block_hashes, save.block_ids, strict=True):
                block = torch.empty(self.kv_cache.block_shape, dtype=self.kv_cache.dtype)
                self.kv_cache.read_block(block_id, block)
                self.store.put(block_hash, block)
            self._finished_sending.add(req_id)
            if self._listener is not None:
                n = len(save.block_hashes)
                self._listener.on_save_done(req_id, SaveResult(True, n, n, time.monotonic_ns()))

    def get_finished(self) -> tuple[set[str], dict[str, int]]:
        sending, recving = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving = set(), {}
        return sending, recving

    def set_listener(self, listener: TransferListener | None) -> None:
        self._listener = listener

    def has_pending(self) -> bool:
        return bool(self._finished_sending or self._finished_recving)

    @property
    def num_load_failures(self) -> int:
        return self._num_load_failures


def create_memory_connector(
    store: MemoryKVStore, kv_transfer_config: KVTransferConfig, layout: KVCacheLayout
) -> tuple[MemoryConnectorScheduler, MemoryConnectorWorker]:
    """Both sides of a memory connector over ``store`` (blocks of ``layout.block_size``)."""
    return (
        MemoryConnectorScheduler(store, layout.block_size, kv_transfer_config.kv_role),
        MemoryConnectorWorker(store),
    )


def register_memory_connector(store: MemoryKVStore) -> str:
    """Register a connector over ``store``; returns the name to put in
    ``KVTransferConfig.kv_connector``. Every engine built with it shares ``store``.

    NOTE: registrations live as long as the test process (one small store each); a
    name is never reused, so no test sees another's store.
    """
    name = f"memory-{next(_names)}"
    register_connector(name, functools.partial(create_memory_connector, store))
    return name
