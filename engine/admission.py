"""Admission of waiting requests and the choice of preemption victims: the scheduler's
policy half (vLLM v1's ``schedule`` waiting loop and ``_preempt_request``, written anew).

``Admission`` is a base class of ``engine.scheduler.Scheduler`` and works on its state
(the attributes declared below); it exists so the policy that decides who runs next is
read, and changed, in one place.

* Waiting requests are admitted in queue order (``engine.request_queue``: FCFS, or
  ``(priority, arrival)``) while the step's token budget, ``max_num_seqs`` and free
  blocks last; the first one that does not fit ends admission for the step, so a later
  (lower-priority) request never overtakes it.
* A preemption victim is the running request that sorts last: highest ``priority``
  value, then latest arrival (arrival only under FCFS).
* Under the priority policy a full batch (``max_num_seqs`` running) does not keep a
  more urgent request waiting: before the step, each ready waiting request beyond the
  free seats that sorts strictly before the batch's victim preempts that victim
  (:meth:`Admission._preempt_for_priority`; vLLM's priority preemption). KV pressure
  preempts as under FCFS, lowest priority first.
"""

from __future__ import annotations

import time
from typing import Literal

from tandem.engine.batches_in_flight import BatchesInFlight
from tandem.engine.config import SchedulerConfig
from tandem.engine.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from tandem.engine.kv_connector import KVConnectorScheduler
from tandem.engine.request import Request, RequestStatus
from tandem.engine.request_queue import RequestQueue
from tandem.engine.step_batch import StepBatch


class Admission:
    """Who runs next: waiting-queue admission and preemption (see the module docstring).

    Not constructed on its own: ``Scheduler`` sets every attribute declared here.
    """

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    connector: KVConnectorScheduler | None
    waiting: RequestQueue
    running: list[Request]
    connector_prefix_cache_stats: PrefixCacheStats
    num_preemptions: int
    _arrival_seq: dict[str, int]
    _remote_requested: dict[str, int]
    batches: BatchesInFlight

    def _num_lookahead(self, req: Request, num_computed: int, num_new: int, num_known: int) -> int:
        raise NotImplementedError

    def _lookahead_slots(self, num_lookahead: int) -> int:
        raise NotImplementedError

    def _schedule_waiting(self, batch: StepBatch) -> None:
        """Admit waiting requests into the running batch (step 2 of ``schedule``), in
        queue order while ``batch.budget``, ``max_num_seqs`` and blocks last.

        Each admitted request joins ``batch`` and ``self.running``; requests waiting for
        a remote load or a grammar, and those whose remote load starts now, are skipped
        and put back in order.
        """
        kvm = self.kv_cache_manager
        skipped: list[Request] = []
        while (self.waiting and batch.budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.peek()
            if req.status in (RequestStatus.WAITING_FOR_REMOTE_KV,
                              RequestStatus.WAITING_FOR_GRAMMAR):
                # until update_from_output reports its load / _poll_grammars finds it ready
                skipped.append(self.waiting.pop())
                continue
            hits, num_hit = KVCacheBlocks(), 0
            has_blocks = kvm.has_blocks(req.request_id)  # True after a remote load
            if not has_blocks:
                hits, num_hit = kvm.get_computed_blocks(req)
                remote = self._start_remote_load(req, hits, num_hit)
                if remote == "no_room":
                    break
                if remote == "skip":
                    skipped.append(self.waiting.pop())
                    continue
            if not self._admit(req, batch, hits, num_hit, has_blocks):
                break
        if skipped:
            self.waiting.prepend(skipped)

    def _start_remote_load(self, req: Request, hits: KVCacheBlocks, num_hit: int
                           ) -> Literal["local", "skip", "no_room"]:
        """Ask the connector for the tokens of ``req`` past its ``num_hit`` locally cached
        ones; when some are remote, allocate blocks for the whole remainder and start
        their load (the request waits in ``WAITING_FOR_REMOTE_KV``).

        Returns:
            "local": nothing to load, admit it here; "skip": its lookup still runs, or
            its load started (take it out of the queue for this step); "no_room": no
            blocks for it, admission ends for the step.
        """
        # prompt logprobs need every prompt position computed: no remote load
        if self.connector is None or req.sampling_params.prompt_logprobs is not None:
            return "local"
        matched = self.connector.get_num_new_matched_tokens(req, num_hit)
        if matched is None:
            return "skip"  # its lookup runs: ask again
        # At least one token must be computed here to produce a sample.
        num_external = min(matched, req.num_tokens - 1 - num_hit)
        if num_external <= 0:
            return "local"
        # NOTE: blocks for every remaining token, not only the remote ones: a loaded
        # request then never waits for one more block while holding the others
        # (requests holding blocks in the waiting queue cannot be preempted, so that
        # could deadlock).
        kvm = self.kv_cache_manager
        if kvm.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits,
                              delay_cache_blocks=True) is None:
            return "no_room"
        kvm.record_prefix_cache_lookup(req, num_hit)
        self._record_connector_lookup(req)
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._remote_requested[req.request_id] = num_external
        self.connector.update_state_after_alloc(
            req, kvm.get_block_ids(req.request_id), num_external
        )
        return "skip"

    def _admit(self, req: Request, batch: StepBatch, hits: KVCacheBlocks, num_hit: int,
               has_blocks: bool) -> bool:
        """Schedule the head of the waiting queue, ``req``, from its ``num_hit`` cached
        tokens (``hits``): pop it, allocate its slots and move it to the running batch.

        Returns:
            False when it does not fit this step (budget with chunking off, or blocks):
            admission ends for the step.
        """
        kvm = self.kv_cache_manager
        num_computed = req.num_computed_tokens + num_hit
        num_known = req.num_tokens - num_computed
        # NOTE: with chunking off a prompt waits for a step with room for all of it; one
        # larger than a whole step (a resumed request, or a remote load that fell short)
        # is chunked anyway, else it would never run.
        if (not self.config.enable_chunked_prefill
                and batch.budget < num_known <= self.config.max_num_batched_tokens):
            return False
        num_new = min(self._prefill_cap(num_known), batch.budget)
        num_ahead = self._num_lookahead(req, num_computed, num_new, num_known)
        num_slots = num_new + self._lookahead_slots(num_ahead)
        if kvm.allocate_slots(req, num_slots, num_hit, hits) is None:
            return False
        self.waiting.pop()
        if not has_blocks:
            kvm.record_prefix_cache_lookup(req, num_hit)
            self._record_connector_lookup(req)
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        batch.add(req, num_new, num_ahead=num_ahead)
        return True

    def _record_connector_lookup(self, req: Request) -> None:
        """Count an admitted request's tokens as queried of the connector's tier."""
        if self.connector is not None:
            self.connector_prefix_cache_stats.num_requests += 1
            self.connector_prefix_cache_stats.queries += req.num_tokens

    def _prefill_cap(self, num_new: int) -> int:
        """``num_new`` tokens capped at ``long_prefill_token_threshold`` (if set)."""
        cap = self.config.long_prefill_token_threshold
        if cap > 0 and self.config.enable_chunked_prefill and num_new > cap:
            return cap
        return num_new

    def _preempt_for_priority(self) -> list[Request]:
        """Priority policy: free seats in a full batch for more urgent waiting requests.

        Walks the ready waiting requests (not those waiting for a remote load or a
        grammar) in priority order; the first ``max_num_seqs - len(running)`` of them
        fit in the free seats, and each later one preempts the running request that
        sorts last (:meth:`_victim_key`) if it sorts strictly before it, until one does
        not. Requests in a batch still in flight are never victims. Victims go back to
        the waiting queue (recomputed later); the waiting requests themselves are
        admitted by the step's normal admission (:meth:`_schedule_waiting`).

        Returns:
            The preempted requests, in preemption order (empty under FCFS).
        """
        if self.config.policy != "priority":
            return []
        ready = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        seats = self.config.max_num_seqs - len(self.running)
        preempted: list[Request] = []
        for req in list(self.waiting):
            if req.status not in ready:
                continue
            if seats > 0:
                seats -= 1
                continue
            victims = self.batches.schedulable(self.running)
            if not victims:
                break
            victim = max(victims, key=self._victim_key)
            if self._victim_key(req) >= self._victim_key(victim):
                break  # the queue is in priority order: no later request outranks it
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _victim_key(self, req: Request) -> tuple[float, ...]:
        seq = self._arrival_seq[req.request_id]
        if self.config.policy == "priority":
            return (req.priority, req.arrival_time, seq)
        return (req.arrival_time, seq)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)  # before resetting num_computed_tokens (see free)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend([req])
