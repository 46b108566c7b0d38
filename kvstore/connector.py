"""The "store" KV connector: prefill publishes KV blocks to the tandem KV store,
decode loads them. It implements the engine's connector interface
(engine/kv_connector.py), which finds it by the name ``"store"``; the engine
never imports this module.

Keys: a block's store key is ``BlockKey(block hash, layout fingerprint)``
(contracts/): the hash chain of the prompt's blocks (``prompt_block_hashes``:
every full block, then the partial last block) and ``KVCacheLayout.fingerprint``,
so blocks of another model or layout are never read. A block's value is the
bytes of ``kv_cache[block_id]`` (all layers, K and V, the whole block even when
only its first tokens are valid).

The engine's cache is either one CPU tensor, whose blocks the store reads and writes
in place (no copy), or a :class:`~tandem.engine.kv_shards.ShardedKVCache` (tensor/
pipeline-parallel ranks' shards, or a cache on a GPU): its blocks move through host
staging buffers in the canonical full-head layout (the full model's, the one the
layout fingerprint names), so engines at any TP/PP share blocks; a save assembles
full blocks from the shards, a load scatters them into every shard (replicas
included).

Producer (prefill, ``kv_producer``): when a request finishes, ``request_finished``
hands its blocks to the transfer thread and returns True (the scheduler keeps
the blocks); the thread asks the store which keys it lacks, uploads those, and
reports the request in ``finished_sending`` (success or failure: the blocks are
freed either way; a failed publish only makes the decode side recompute). The prefill
answers before that (services/prefill/servicer.py); when the put ends, the thread writes
the request's publish marker (ok or failed, kvstore/arrival.py) for a decode waiting on
those blocks.

Store lookups (both roles, ``load_from_store``): a request without block hashes (a
prefill, or a decode instance's local prefill) looks up the full blocks of its prompt
beyond the local prefix-cache hit in the store index (one batched lookup, metadata only:
:class:`~tandem.kvstore.lookup.IndexProbe`) and loads the leading run present, exactly as
a decode loads a prefill's blocks; the loaded blocks join the local prefix cache. The
last prompt token is always computed (it yields the sample). The lookup runs on a thread
of its own: until it answers, ``get_num_new_matched_tokens`` says "not known yet" and the
request waits (other requests keep running), so a slow or unreachable index never stalls
the engine's step loop; the listener's ``on_lookup_done`` wakes the engine.

Consumer (decode, ``kv_consumer``): a request whose ``kv_transfer_params``
(``contracts.block_key.KVTransferParams``) hold the prompt's block hashes under
this engine's layout fingerprint reports the prompt tokens beyond its local
prefix-cache hit as remote. After the scheduler
allocated blocks, the load runs on the transfer thread (other requests keep
decoding); it fetches the blocks in order and stops at the first miss or bad
checksum, reporting the tokens it did load; the scheduler recomputes the rest,
and :attr:`StoreConnectorWorker.num_load_failures` counts such requests. When the
prefill answered before its publish ended (``KVTransferParams.publish_pending``), a
clean miss first parks the load in an :class:`~tandem.kvstore.arrival.ArrivalWaiter`
(up to ``kv_load_wait_s``; no transfer thread is held) and the load goes on with what
arrived.
With ``publish_output``, a finished request's full blocks of prompt + output (the hash
chain continues through the generated tokens) are published on the transfer thread, so
the next turn of a conversation finds them; its response stream is not held up (the
last token is already out), only its blocks stay allocated until the put is done.
Blocks this request itself loaded from the store are not sent again.

Settings: ``kvstore.config.StoreConnectorConfig``, built once by the service's
entry point.
Tests that need another block store register a connector built by
:func:`build_store_connector` with their own client.

NOTE: both sides share one ``_Transfers`` object (they live in one process).
A save is submitted by ``request_finished`` directly instead of through the
next step's metadata: the blocks are final then (the forward that computed them
has returned), and waiting for the next step would add a whole forward pass to
the prefill's time to answer.

Parts, one job each (this module is the factory and re-exports the names others use):

- ``connector_scheduler.py``: :class:`StoreConnectorScheduler` (which tokens are
  remote, what to load, what to publish) and the step's :class:`StoreConnectorMetadata`;
- ``connector_worker.py``: :class:`StoreConnectorWorker` (the cache it serves, loads it
  starts, transfers it reports);
- ``connector_transfers.py``: the transfer threads and the state both sides share
  (``_Transfers``), the jobs, host staging buffers, loads parked for an arriving publish;
- ``connector_lookups.py``: store index lookups of waiting requests on their own thread
  (``_Lookups``), the prefetch, lookups parked for an earlier turn's publish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.config import KVTransferConfig
from tandem.kvstore.arrival import ArrivalSignal
from tandem.kvstore.config import StoreConnectorConfig
from tandem.kvstore.connector_lookups import StoreProbe
from tandem.kvstore.connector_scheduler import StoreConnectorMetadata, StoreConnectorScheduler
from tandem.kvstore.connector_transfers import _Transfers
from tandem.kvstore.connector_worker import StoreConnectorWorker
from tandem.kvstore.store import BlockStore

__all__ = [
    "StoreConnectorConfig",
    "StoreConnectorMetadata",
    "StoreConnectorScheduler",
    "StoreConnectorWorker",
    "StoreProbe",
    "build_store_connector",
    "create_connector",
]


def build_store_connector(
    kv_role: str,
    layout: KVCacheLayout,
    client_factory: Callable[[], BlockStore],
    num_transfer_threads: int = 2,
    *,
    probe: StoreProbe | None = None,
    publish_output: bool = False,
    signal: ArrivalSignal | None = None,
    load_wait_s: float = 0.0,
) -> tuple[StoreConnectorScheduler, StoreConnectorWorker]:
    """Both sides of a store connector over the client ``client_factory()`` returns.

    The factory is called once, on a transfer thread (connecting may be slow); a
    failed connection is retried by the next transfer. Starts the transfer threads
    (stopped by the worker side's ``shutdown``).

    Args:
        probe: store index lookup for requests without block hashes (``None``: off);
            called on a lookup thread of its own (metadata only: one round trip).
        publish_output: a consumer publishes finished requests' prompt + output blocks.
        signal: the index as kvstore/arrival.py reads and writes it: a producer marks its
            publishes ended there, a consumer waits there for blocks a prefill still
            publishes (``None``: no markers, no waiting); closed by ``shutdown``.
        load_wait_s: how long a consumer's load waits for such blocks, seconds (0: not
            at all; a miss is recomputed at once).

    Raises:
        ValueError: ``num_transfer_threads < 1`` or ``load_wait_s < 0``.
    """
    transfers = _Transfers(client_factory, num_transfer_threads, signal, load_wait_s)
    return (
        StoreConnectorScheduler(transfers, kv_role, layout.block_size, layout.fingerprint,
                                probe, publish_output),
        StoreConnectorWorker(transfers, layout),
    )


def create_connector(
    kv_transfer_config: KVTransferConfig, layout: KVCacheLayout
) -> tuple[StoreConnectorScheduler, StoreConnectorWorker]:
    """Factory of the ``"store"`` connector (registered in engine/kv_connector.py): a
    :class:`~tandem.kvstore.client.KVStoreClient` per :class:`StoreConnectorConfig`.

    Raises:
        ValueError: ``kv_transfer_config.connector_config`` is not a ``StoreConnectorConfig``.
    """
    config = kv_transfer_config.connector_config
    if not isinstance(config, StoreConnectorConfig):
        raise ValueError(
            "connector_config must be a StoreConnectorConfig for the store connector, got "
            f"{type(config).__name__}"
        )

    def connect() -> BlockStore:
        from tandem.kvstore.client import KVStoreClient  # UCX only once a transfer runs

        # With the layout, the client rejects a key or block of another layout.
        return KVStoreClient(
            config.redis_url, layout=layout, local_node=config.kvstore_address,
            timeout_s=config.kvstore_timeout_s, options=config.client_options,
        )

    probe = None
    if config.load_from_store:
        from tandem.kvstore.lookup import IndexProbe

        index = IndexProbe(config.redis_url, timeout_s=config.lookup_timeout_s)
        threading.Thread(target=index.warm, name="kv-index-warm", daemon=True).start()
        probe = index.leading
    signal = None
    role = kv_transfer_config.kv_role
    if (role in ("kv_producer", "kv_both") or config.kv_load_wait_s > 0
            or config.publish_output):
        from tandem.kvstore.arrival import RedisArrivalSignal

        signal = RedisArrivalSignal(config.redis_url, timeout_s=config.lookup_timeout_s)
    return build_store_connector(
        role, layout, connect, config.num_transfer_threads,
        probe=probe, publish_output=config.publish_output,
        signal=signal, load_wait_s=config.kv_load_wait_s,
    )
