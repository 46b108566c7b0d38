"""The store connector's worker side (kvstore/connector.py names the parts): the KV
cache it serves, the loads it starts, the transfers it reports.
"""

from __future__ import annotations

import torch

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.kv_connector import KVConnectorWorker, TransferListener
from tandem.engine.kv_shards import ShardedKVCache
from tandem.kvstore.connector_scheduler import StoreConnectorMetadata
from tandem.kvstore.connector_transfers import _Transfers


class StoreConnectorWorker(KVConnectorWorker):
    """Worker side: starts loads on the transfer thread and reports finished transfers."""

    def __init__(self, transfers: _Transfers, layout: KVCacheLayout) -> None:
        self._transfers = transfers
        self._layout = layout

    def register_kv_caches(self, kv_cache: torch.Tensor | ShardedKVCache) -> None:
        """Serve ``kv_cache``: a tensor ``[num_blocks, *layout.block_shape]`` (contiguous;
        on CPU the store reads and writes its blocks in place) or a
        :class:`~tandem.engine.kv_shards.ShardedKVCache` whose full block is the
        layout's (moved through host staging buffers).

        Raises:
            ValueError: another block shape or dtype than the layout's, or a tensor that
                is not contiguous.
        """
        expected = self._layout.block_shape
        dtype = getattr(torch, self._layout.dtype)
        if isinstance(kv_cache, ShardedKVCache):
            if kv_cache.block_shape != expected:
                raise ValueError(
                    f"kv_cache's full block must be {expected} (the layout's), got "
                    f"{kv_cache.block_shape}")
            got = kv_cache.dtype
        else:
            if kv_cache.dim() != 6 or tuple(kv_cache.shape[1:]) != expected:
                raise ValueError(
                    f"kv_cache must be [num_blocks, {', '.join(map(str, expected))}], "
                    f"got shape {tuple(kv_cache.shape)}"
                )
            if not kv_cache.is_contiguous():
                raise ValueError("kv_cache must be contiguous (block b = kv_cache[b])")
            got = kv_cache.dtype
        if got != dtype:
            raise ValueError(f"kv_cache must have dtype {dtype} (the layout's), got {got}")
        self._transfers.attach(kv_cache)

    def start_load_kv(self, meta: object) -> None:
        if isinstance(meta, StoreConnectorMetadata):
            for job in meta.loads.values():
                self._transfers.submit(job)

    def save_kv(self, meta: object) -> None:
        """Nothing: saves start in ``request_finished`` (see kvstore/connector.py's NOTE)."""

    def get_finished(self) -> tuple[set[str], dict[str, int]]:
        return self._transfers.get_finished()

    def set_listener(self, listener: TransferListener | None) -> None:
        """Receive each transfer's outcome (called on the transfer thread)."""
        self._transfers.listener = listener

    def has_pending(self) -> bool:
        """Transfers in flight or finished but not yet collected by ``get_finished``."""
        return self._transfers.num_pending() > 0

    @property
    def num_load_failures(self) -> int:
        """Requests whose remote KV was partly missing or corrupt (recomputed), since start."""
        return self._transfers.num_load_failures

    @property
    def num_loads_waiting(self) -> int:
        """Loads parked until blocks a prefill is still publishing arrive."""
        waiter = self._transfers.waiter
        return 0 if waiter is None else waiter.num_parked()

    @property
    def lookup_waits(self) -> dict[str, int]:
        """Store lookups that waited for an earlier request's output publish
        (``PublishInFlight``), by how the wait ended (kvstore/arrival.py's outcomes)."""
        lookups = self._transfers.lookups
        return {} if lookups is None else lookups.wait_counts()

    def shutdown(self) -> None:
        """Finish queued transfers, stop the transfer thread, close the store client."""
        self._transfers.close()
