"""Continuous-batching scheduler: token budget, mixed batches, chunked prefill,
preemption by recompute, prefix caching and remote KV (after vLLM v1's
``vllm/v1/core/sched/scheduler.py``, written anew).

One step (``schedule``):

1. Running requests, decodes first: each gets ``min(remaining, budget)`` tokens
   (a running request with more than one token left is a chunked prefill).
   When the pool has no block for one, running requests are preempted, lowest
   priority first (highest ``priority`` value, then latest arrival; arrival
   only under FCFS): their blocks are freed, ``num_computed_tokens`` goes back
   to 0 and they return to the front of the waiting queue to be recomputed.
   Under the priority policy, before this, a full batch (``max_num_seqs``) gives
   up its lowest-priority requests to more urgent waiting ones (``engine.admission``).
2. If nothing was preempted for blocks, waiting requests in policy order while budget,
   ``max_num_seqs`` and blocks last: the longest cached prefix is reused; with
   a connector, tokens available remotely are allocated and loaded first (the
   request waits in ``WAITING_FOR_REMOTE_KV`` without using the budget); a
   prompt longer than the remaining budget is chunked (or, with chunked
   prefill off, waits for a step where it fits).

``request.num_computed_tokens`` is advanced in ``update_from_output``, which
also appends sampled tokens, applies stop conditions and frees finished
requests (after the connector saved them, if it asks to): the output half, in
``engine.step_results`` (``StepResults``, a base class as ``Admission`` is).

Structured outputs (with a ``StructuredOutputManager``): a constrained request waits in
``WAITING_FOR_GRAMMAR`` (skipped like one waiting for remote KV) until its grammar has
compiled; each ``schedule`` first polls those requests and ends by asking the manager
for the bitmask of the constrained requests sampled this step; ``update_from_output``
advances each one's matcher by its token and finishes it ("stop") once the grammar
is complete.

Speculative decoding (with a ``SpeculativeConfig``): a decoding request whose proposer
left draft tokens (``Request.spec_token_ids``) is scheduled for ``1 + k`` tokens, its
last known token and ``k`` drafts, verified in the same forward; ``update_from_output``
appends what the rejection sampler emitted and rolls ``num_computed_tokens`` back by
the rejected drafts (their KV slots are simply overwritten later; prefix-cache hashes
only ever cover ``all_token_ids``, which never hold an unverified token). How many
drafts each request gets is ``spec_decode.policy``'s rule.

Batch queue (``max_concurrent_batches`` > 1, pipeline parallelism): the engine core
schedules the next batch before the previous one's results came back; which requests
are in a batch in flight (not scheduled again nor preempted until it is applied, a
share of the running requests per batch) is ``engine.batches_in_flight``'s.

The step's pieces are small collaborators: the batch being built (``engine.step_batch``),
admission and preemption (``engine.admission``), the batches in flight, the draft policy
(``engine.spec_decode.policy``), grammar waits (the ``StructuredOutputManager``) and the
output half (``engine.step_results``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.admission import Admission
from tandem.engine.batches_in_flight import BatchesInFlight
from tandem.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from tandem.engine.kv_connector import KVConnectorScheduler
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.request_queue import create_request_queue
from tandem.engine.sched_output import SchedulerOutput
from tandem.engine.spec_decode.policy import SpecDecodePolicy, SpecDecodeStats
from tandem.engine.step_batch import StepBatch
from tandem.engine.step_results import StepResults
from tandem.engine.validation import RequestError, RequestLimits, validate_request

if TYPE_CHECKING:
    from tandem.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStats:
    """Snapshot of the scheduler for metrics and load reports.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests waiting (including ``num_waiting_for_remote_kv``).
        num_waiting_for_remote_kv: requests whose KV is being loaded.
        kv_cache_usage: fraction of KV blocks held by requests, in [0, 1].
        num_free_blocks / num_total_blocks: KV blocks (free includes cached-but-unused).
        prefix_cache_queries / prefix_cache_hits: cumulative, in tokens (the local
            prefix cache: queries count each admitted request's tokens).
        connector_prefix_cache_queries / connector_prefix_cache_hits: the same for the
            connector's tier (the KV store): tokens of each request admitted while a
            connector was asked, and tokens actually loaded from it (vLLM's
            ``connector_prefix_cache_stats``; 0 without a connector).
        num_preemptions: cumulative preemptions.
        num_kv_load_failures: cumulative remote loads that returned fewer tokens
            than requested (the rest was recomputed).
        num_pending_kv_sends: finished requests whose blocks wait for a save.
        spec_decode: cumulative draft-acceptance counters (speculative decoding), else
            ``None``.
    """

    num_running: int
    num_waiting: int
    num_waiting_for_remote_kv: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_kv_load_failures: int
    num_pending_kv_sends: int
    spec_decode: SpecDecodeStats | None = None
    connector_prefix_cache_queries: int = 0
    connector_prefix_cache_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


class Scheduler(Admission, StepResults):
    """Decides which tokens of which requests run in each step.

    Args:
        scheduler_config: budget, ``max_num_seqs``, policy, chunked prefill.
        cache_config: block size and prefix caching.
        num_blocks: KV blocks in the cache tensor.
        max_model_len: context length (prompt + output) in tokens.
        connector: scheduler side of a KV connector, or ``None`` (colocated).
        structured_output: the engine's grammar manager; requests with
            ``structured_outputs`` wait in ``WAITING_FOR_GRAMMAR`` until it has compiled
            their grammar, each step gets its token bitmask
            (``SchedulerOutput.grammar_bitmask``) and every sampled token advances the
            request's matcher. ``None``: such requests are rejected.
        speculative: speculative decoding's config (``None``: off); decodes then verify
            the draft tokens the runner proposed for them.
        max_concurrent_batches: batches the engine core keeps in flight (the batch queue,
            module docstring); 1: each ``schedule`` is applied before the next.

    Single-threaded: every method is called from the engine thread.
    ``schedule`` and ``update_from_output`` alternate (with ``max_concurrent_batches``
    > 1: up to that many ``schedule`` calls ahead, applied in order); ``add_request``,
    ``abort_requests`` and ``finish_requests`` come between steps.

    Raises:
        ValueError: ``max_model_len`` or ``max_concurrent_batches`` < 1.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
        structured_output: StructuredOutputManager | None = None,
        speculative: SpeculativeConfig | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.batches = BatchesInFlight(max_concurrent_batches)
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        # NOTE: a sequence can never outgrow the whole KV cache; past that it would
        # preempt itself forever, so the cache capacity caps the length too.
        self.max_seq_len = min(max_model_len, num_blocks * cache_config.block_size)
        if self.max_seq_len < max_model_len:
            logger.warning(
                "KV cache holds %d tokens (%d blocks), less than max_model_len %d: "
                "sequences finish with 'length' at %d tokens",
                num_blocks * self.block_size,
                num_blocks,
                max_model_len,
                self.max_seq_len,
            )
        #: What a prompt must fit (the engine adds the vocabulary).
        self.limits = RequestLimits(
            max_model_len=max_model_len,
            max_kv_tokens=num_blocks * cache_config.block_size,
            max_prefill_tokens=(
                None if scheduler_config.enable_chunked_prefill
                else scheduler_config.max_num_batched_tokens
            ),
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching
        )
        self.connector = connector
        self.structured_output = structured_output
        self.requests: dict[str, Request] = {}  # every unfinished request
        # Requests whose grammar is compiling (also in the waiting queue).
        self._waiting_for_grammar: dict[str, Request] = {}
        # Outputs of requests finished between steps (grammar failed or completed at
        # once), returned by the next update_from_output.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self._arrival_seq: dict[str, int] = {}
        self._seq = itertools.count()
        # Remote loads in flight: request id -> tokens requested.
        self._remote_requested: dict[str, int] = {}
        # Finished requests whose blocks the connector still reads (or writes).
        self._pending_free: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_kv_load_failures = 0
        self.spec: SpecDecodePolicy | None = (
            SpecDecodePolicy(speculative, self.max_seq_len) if speculative is not None else None
        )
        # Tokens asked of / loaded from the connector's tier (the local tier's are kvm's).
        self.connector_prefix_cache_stats = PrefixCacheStats()

    # -- admission ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING).

        Raises:
            ValueError: duplicate ``request_id`` (``check_request_id``); a prompt that
                breaks :attr:`limits` (``engine.validation.validate_request``: empty,
                no room for a token in ``max_model_len`` or in the KV cache, or, with
                chunked prefill off, more than ``max_num_batched_tokens``).
            RequestError: ``structured_outputs`` on a scheduler without a grammar manager.
        """
        self.check_request_id(request.request_id)
        validate_request(request.prompt_token_ids, request.sampling_params, self.limits)
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"request status must be WAITING, got {request.status.name}")
        constrained = request.sampling_params.structured_outputs is not None
        if constrained and self.structured_output is None:
            raise RequestError(
                "structured_outputs", "structured_outputs: this engine has no grammar backend"
            )
        rid = request.request_id
        if constrained:
            assert self.structured_output is not None
            self.structured_output.add_request(request)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._waiting_for_grammar[rid] = request
        self.requests[rid] = request
        self._arrival_seq[rid] = next(self._seq)
        self.waiting.add(request)

    def check_request_id(self, request_id: str) -> None:
        """Raises: ValueError naming ``request_id`` when it is in use (unfinished, or
        finished with its blocks still held for the connector)."""
        if (request_id in self.requests or request_id in self._pending_free
                or self.batches.holds(request_id)):
            raise ValueError(f"request_id {request_id!r} is already in the engine")

    # -- scheduling --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build the next step's batch (see the module docstring). Never raises for
        lack of blocks: requests wait or are preempted instead."""
        if self._waiting_for_grammar:
            self._poll_grammars()
        batch = StepBatch(self.config.max_num_batched_tokens)
        # 0. Priority policy: a full batch makes room for more urgent waiting requests.
        seat_victims = self._preempt_for_priority()
        # 1. Running requests, decodes first.
        self._schedule_running(batch)
        if batch.spec_tokens and self.spec is not None and not self.spec.worth_verifying(
                sum(len(d) for d in batch.spec_tokens.values()),
                sum(1 for r in batch.scheduled if r.num_tokens - r.num_computed_tokens == 1)):
            # Too few drafts to pay for leaving the one-token decode path (policy.py).
            batch.drop_drafts()
        # 2. Waiting requests (not in a step that had to preempt: blocks are short).
        if not batch.preempted:
            self._schedule_waiting(batch)
        return self._step_output(batch, seat_victims)

    def _schedule_running(self, batch: StepBatch) -> None:
        """Step 1 of ``schedule``: the running requests not in a batch in flight, decodes
        first, each its known tokens (capped by the budget and the long-prefill cap) and
        its drafts; preempts for blocks (``_make_room``)."""
        running = self.batches.schedulable(self.running)
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for req in self.batches.share(decodes + prefills, len(self.running)):
            if batch.budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_known = req.num_tokens - req.num_computed_tokens
            num_new = min(self._prefill_cap(num_known), batch.budget)
            if num_new <= 0:
                continue
            drafts: list[int] = []
            if self.spec is not None and num_known == 1:
                drafts = req.spec_token_ids[: self.spec.num_verified(req, batch.budget)]
            num_ahead = self._num_lookahead(req, req.num_computed_tokens, num_new, num_known)
            num_slots = num_new + len(drafts) + self._lookahead_slots(num_ahead)
            if self._make_room(req, num_slots, running, batch):
                batch.add(req, num_new, drafts, num_ahead)

    def _make_room(self, req: Request, num_slots: int, victims: list[Request],
                   batch: StepBatch) -> bool:
        """Allocate ``num_slots`` KV slots for ``req``, preempting the running request
        that sorts last (``_victim_key``, among ``victims``) until they fit; a victim
        scheduled earlier in the step is taken back out of ``batch``.

        Returns:
            Whether ``req`` still runs (False: it was preempted itself).
        """
        kvm = self.kv_cache_manager
        while kvm.allocate_slots(req, num_slots) is None:
            victim = max(victims, key=self._victim_key)
            if victims is not self.running:
                victims.remove(victim)
            batch.take_back(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                break
        return req.status == RequestStatus.RUNNING

    def _step_output(self, batch: StepBatch, seat_victims: list[Request]) -> SchedulerOutput:
        """The ``SchedulerOutput`` of a built batch, with the connector's metadata and
        the grammar bitmask of its sampled constrained requests."""
        kvm = self.kv_cache_manager
        scheduled, num_scheduled = batch.scheduled, batch.num_scheduled
        out = SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            block_tables={r.request_id: kvm.get_block_ids(r.request_id) for r in scheduled},
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids={r.request_id for r in batch.preempted + seat_victims},
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_token_ids=batch.spec_tokens,
            num_lookahead_tokens=batch.lookahead,
        )
        self.batches.add(num_scheduled)
        if out.total_num_scheduled_tokens:
            # NOTE: an empty step never reaches the executor, so its finished ids wait
            # for the next step that does (the workers drop per-request state by them).
            self.finished_req_ids = set()
        else:
            out.finished_req_ids = set(self.finished_req_ids)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if self.structured_output is not None:
            sampled = [r for r in scheduled if out.is_sampled(r)]
            out.grammar_bitmask = self.structured_output.grammar_bitmask(
                sampled, batch.spec_tokens
            )
        return out

    def _num_lookahead(self, req: Request, num_computed: int, num_new: int, num_known: int) -> int:
        """Draft tokens to propose for ``req`` after a step of ``num_new`` of its
        ``num_known`` uncomputed tokens, ``num_computed`` computed before it (0 unless
        that step samples it)."""
        if self.spec is None or num_new != num_known:
            return 0
        return self.spec.num_lookahead(req, len(self.running), num_computed + num_new)

    def _lookahead_slots(self, num_lookahead: int) -> int:
        """KV slots to reserve past a step's tokens for the proposer (a draft model
        writes its own KV for its proposals there)."""
        return num_lookahead if self.spec is not None and self.spec.needs_lookahead_slots else 0

    def _poll_grammars(self) -> None:
        """Move requests whose grammar compiled to WAITING; fail those whose grammar did
        not compile (or timed out, or rejects a token the request already has)."""
        manager = self.structured_output
        assert manager is not None, "constrained requests imply a manager"
        failed: list[tuple[Request, RequestError]] = []
        done: list[Request] = []
        for rid, req in list(self._waiting_for_grammar.items()):
            result = manager.poll(req)
            if result is False:
                continue
            del self._waiting_for_grammar[rid]
            if isinstance(result, RequestError):
                failed.append((req, result))
            elif manager.is_terminated(req):
                done.append(req)  # the tokens it came with already complete the grammar
            else:
                req.status = RequestStatus.WAITING
        for req, error in failed:
            logger.info("%s: %s", req.request_id, error)
            self.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(
                EngineCoreOutput(req.request_id, [], finish_reason="abort", error=error)
            )
        for req in done:
            self.finish_requests(req.request_id, RequestStatus.FINISHED_STOPPED)
            self._pending_outputs.append(EngineCoreOutput(req.request_id, [], finish_reason="stop"))

    # -- introspection -----------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while requests wait or run, or finished ones still hold blocks for a save
        (the engine must keep stepping so the connector's results are collected) or for
        a batch in flight."""
        return bool(self.requests or self._pending_free or self._pending_outputs
                    or self.batches.has_held_blocks)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine core keeps in flight (``BatchesInFlight``)."""
        return self.batches.max_concurrent_batches

    @max_concurrent_batches.setter
    def max_concurrent_batches(self, value: int) -> None:
        """Raises: ValueError naming ``max_concurrent_batches`` when < 1."""
        self.batches.max_concurrent_batches = value

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_stats(self) -> SchedulerStats:
        kvm = self.kv_cache_manager
        prefix = kvm.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_for_remote_kv=sum(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.waiting
            ),
            kv_cache_usage=kvm.usage,
            num_free_blocks=kvm.num_free_blocks,
            num_total_blocks=kvm.num_total_blocks,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_kv_load_failures=self.num_kv_load_failures,
            num_pending_kv_sends=len(self._pending_free),
            spec_decode=(
                dataclasses.replace(
                    self.spec.stats,
                    num_accepted_tokens_per_pos=list(self.spec.stats.num_accepted_tokens_per_pos),
                )
                if self.spec is not None
                else None
            ),
            connector_prefix_cache_queries=self.connector_prefix_cache_stats.queries,
            connector_prefix_cache_hits=self.connector_prefix_cache_stats.hits,
        )
