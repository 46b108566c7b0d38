"""The store connector's scheduler side (kvstore/connector.py names the parts): which
prompt tokens are remote, the loads each step starts, and the publish of a finished
request's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.contracts.block_hash import BlockHash, hash_token_blocks, prompt_block_hashes
from tandem.contracts.block_key import BlockKey
from tandem.engine.kv_connector import KVConnectorScheduler
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sched_output import SchedulerOutput
from tandem.kvstore.connector_lookups import StoreProbe, _Lookups
from tandem.kvstore.connector_transfers import _Job, _Transfers
from tandem.kvstore.index import output_marker_key, publish_marker_key


@dataclass
class StoreConnectorMetadata:
    """Loads recorded by the scheduler side in one step: request id -> job."""

    loads: dict[str, _Job] = field(default_factory=dict)


class StoreConnectorScheduler(KVConnectorScheduler):
    """Scheduler side: which tokens are remote, what to load, what to publish.

    Args:
        probe: the store index lookup of ``load_from_store`` (``None``: requests without
            block hashes load nothing).
        publish_output: a consumer publishes prompt + output blocks of finished requests.
    """

    def __init__(
        self,
        transfers: _Transfers,
        kv_role: str,
        block_size: int,
        fingerprint: bytes,
        probe: StoreProbe | None = None,
        publish_output: bool = False,
    ) -> None:
        self._transfers = transfers
        self.is_producer = kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_role in ("kv_consumer", "kv_both")
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.publish_output = publish_output and self.is_consumer
        self._loads: dict[str, _Job] = {}
        # Waiting requests' store lookups (one per request and local hit).
        self._lookups = (_Lookups(probe, transfers, block_size)
                         if probe is not None else None)
        transfers.lookups = self._lookups

    def _remote_hashes(self, request: Request) -> tuple[BlockHash, ...] | None:
        params = request.kv_transfer_params
        if not self.is_consumer or params is None or not params.block_hashes:
            return None
        if params.layout_fingerprint != self.fingerprint:
            return None  # another layout's blocks: recompute (the service rejects these)
        return params.block_hashes

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> int | None:
        if request.kv_transfer_params is None:
            return self._store_hit(request, num_computed_tokens)
        # NOTE: optimistic (no store lookup on the step loop): the producer published
        # the whole prompt; a block missing at load time is reported then and recomputed.
        hashes = self._remote_hashes(request)
        if hashes is None:
            return 0
        covered = min(len(hashes) * self.block_size, request.num_prompt_tokens)
        return max(0, covered - num_computed_tokens)

    def prefetch(self, request: Request) -> None:
        """Start the store lookup of a prompt arriving for this engine (thread-safe).

        Only requests that would ask the store at admission (no handoff's
        ``kv_transfer_params``) and have a full block before their last token."""
        if self._lookups is None or request.kv_transfer_params is not None:
            return
        bs = self.block_size
        stop = (len(request.prompt_token_ids) - 1) // bs
        if stop <= 0:
            return
        tokens = list(request.prompt_token_ids[: stop * bs])
        salt = request.cache_salt
        self._lookups.prefetch(request, stop,
                               lambda: hash_token_blocks(tokens, bs, cache_salt=salt),
                               self.fingerprint)

    def drop_prefetch(self, request: Request) -> None:
        """Forget a prefetched lookup of a request the engine did not take."""
        if self._lookups is not None:
            self._lookups.pop(request)

    def _store_hit(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens of the leading run of full blocks after the local hit that the store
        index holds; ``None`` while its lookup (one per request and local hit) runs."""
        if self._lookups is None:
            return 0
        bs = self.block_size
        start = num_computed_tokens // bs
        # full blocks only, and never the last token: the engine computes it
        stop = (request.num_tokens - 1) // bs
        if stop <= start:
            return 0
        tokens = request.all_token_ids
        found = self._lookups.get(request, start, stop,
                                  lambda: hash_token_blocks(tokens[: stop * bs], bs,
                                                            cache_salt=request.cache_salt),
                                  self.fingerprint)
        return None if found is None else found.num_blocks * bs

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        found = self._lookups.pop(request) if self._lookups is not None else None
        hashes: Sequence[BlockHash] | None = self._remote_hashes(request)
        params = request.kv_transfer_params
        # a prefill still publishing these blocks: a miss waits for them (kvstore/arrival.py)
        wait = hashes is not None and params is not None and params.publish_pending
        if hashes is None and found is not None:
            hashes = found.hashes
        assert hashes is not None, f"{rid}: remote tokens without block hashes"
        bs = self.block_size
        start = request.num_computed_tokens
        stop = start + num_external_tokens
        first, last = start // bs, -(-stop // bs)
        assert last <= len(hashes), f"{request.request_id}: load past the remote blocks"
        self._loads[request.request_id] = _Job(
            request_id=request.request_id,
            is_save=False,
            keys=[BlockKey(h, self.fingerprint) for h in hashes[first:last]],
            block_ids=list(block_ids[first:last]),
            num_tokens=[min((i + 1) * bs, stop) - max(i * bs, start) for i in range(first, last)],
            first_block=first,
            wait=wait,
            marker_key=publish_marker_key(BlockKey(hashes[-1], self.fingerprint), rid)
            if wait else "",
        )

    def build_connector_meta(self, sched_out: SchedulerOutput) -> StoreConnectorMetadata | None:
        if not self._loads:
            return None
        meta = StoreConnectorMetadata(loads=self._loads)
        self._loads = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        if self._lookups is not None:
            self._lookups.pop(request)
        if self._loads.pop(rid, None) is not None:
            return False  # its load was never started: nothing writes into the blocks
        if self._transfers.cancel(rid):
            return True  # a load is writing into the blocks: keep them until it reports
        loaded = self._transfers.pop_loaded_blocks(rid)
        tokens = request.all_token_ids[: request.num_computed_tokens]
        marker = ""
        if self.is_producer:
            if request.status == RequestStatus.FINISHED_ABORTED:
                return False  # the prefill handler waits for no save of an abort
            # The prompt: full blocks, then the partial tail (what a decode loads).
            hashes = prompt_block_hashes(tokens, self.block_size,
                                         cache_salt=request.cache_salt)
            if hashes:
                # what a decode that waits for these blocks polls (kvstore/arrival.py)
                marker = publish_marker_key(BlockKey(hashes[-1], self.fingerprint), rid)
        elif self.publish_output:
            # NOTE: an abort too (a stop string ends a stream that way): the KV of the
            # computed tokens is right whatever ended the request.
            hashes = hash_token_blocks(tokens, self.block_size, cache_salt=request.cache_salt)
            if hashes and self._transfers.signal is not None:
                # what the next turn's lookup waits for (PublishInFlight)
                marker = output_marker_key(self.fingerprint, rid)
        else:
            return False
        if not hashes:
            return False
        assert len(hashes) <= len(block_ids), f"{rid}: fewer blocks than computed KV"
        bs = self.block_size
        # A producer always submits (its handler waits for the outcome), even when the
        # store already holds every block; so does an output publish with an end marker
        # (a next turn may wait for it).
        send = [i for i in range(len(hashes)) if i not in loaded]
        if not send and not self.is_producer and not marker:
            return False
        self._transfers.submit(
            _Job(
                request_id=rid,
                is_save=True,
                keys=[BlockKey(hashes[i], self.fingerprint) for i in send],
                block_ids=[block_ids[i] for i in send],
                num_tokens=[min(bs, len(tokens) - i * bs) for i in send],
                marker_key=marker,
                trace_headers=request.trace_headers,
            )
        )
        return True
