"""Applying a step's results and finishing requests: the scheduler's output half (vLLM
v1's ``update_from_output``, ``finish_requests`` and ``_free_request``, written anew).

``StepResults`` is a base class of ``engine.scheduler.Scheduler`` and works on its state
(the attributes declared below), as ``engine.admission.Admission`` does for the policy
half; it exists so what happens after a step (tokens appended, stop rule, grammar,
finished requests and their blocks, the connector's transfer results) is read in one
place.

* ``update_from_output`` advances each scheduled request by its computed tokens
  (rolled back by rejected drafts), appends its sampled tokens through the grammar and
  the stop rule, and finishes the requests that stopped.
* A finished request's blocks are freed at once, or kept while a batch in flight still
  writes them (the batch queue) or while the connector saves them.
* Transfer results: a remote load that finished moves its request back to ``WAITING``
  (with the tokens it got); a save that finished frees the blocks kept for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from tandem.engine.batches_in_flight import BatchesInFlight
from tandem.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats
from tandem.engine.kv_connector import KVConnectorScheduler
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request, RequestStatus
from tandem.engine.request_queue import RequestQueue
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.spec_decode.policy import SpecDecodePolicy
from tandem.engine.stop import check_stop
from tandem.engine.validation import RequestError

if TYPE_CHECKING:
    from tandem.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class StepResults:
    """What follows a step: results applied, requests finished (see the module docstring).

    Not constructed on its own: ``Scheduler`` sets every attribute declared here.
    """

    kv_cache_manager: KVCacheManager
    connector: KVConnectorScheduler | None
    structured_output: StructuredOutputManager | None
    spec: SpecDecodePolicy | None
    max_seq_len: int
    requests: dict[str, Request]
    waiting: RequestQueue
    running: list[Request]
    finished_req_ids: set[str]
    connector_prefix_cache_stats: PrefixCacheStats
    num_kv_load_failures: int
    _pending_outputs: list[EngineCoreOutput]
    _waiting_for_grammar: dict[str, Request]
    _arrival_seq: dict[str, int]
    _remote_requested: dict[str, int]
    _pending_free: dict[str, Request]
    batches: BatchesInFlight

    def update_from_output(
        self,
        sched: SchedulerOutput,
        out: ModelRunnerOutput,
        finished_recving: Mapping[str, int] | Iterable[str] = (),
        finished_sending: Iterable[str] = (),
    ) -> list[EngineCoreOutput]:
        """Apply one step's results.

        Advances ``num_computed_tokens`` of the scheduled requests, appends each
        sampled token (with its logprobs) and checks, in order: EOS (unless
        ``ignore_eos``) and ``stop_token_ids`` -> "stop", only once more than
        ``min_tokens`` tokens were generated; ``max_tokens`` and
        ``max_model_len`` -> "length"; else a ``prefill_only`` request ends
        "prefill_done" after its first token. Finished requests leave the batch and
        free their blocks, unless the connector keeps them for a save.

        Args:
            sched / out: the step's batch and the model runner's result. May be an
                empty batch, to deliver transfer results only.
            finished_recving: request id -> tokens loaded (a set means fully loaded).
            finished_sending: request ids whose save completed.

        Returns:
            One ``EngineCoreOutput`` per request that got a token this step.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        for finished in self.batches.land(sched):
            self._free_blocks(finished)
        stopped: set[str] = set()
        for req in sched.scheduled_requests:
            rid = req.request_id
            if req.status != RequestStatus.RUNNING:
                continue  # finished or preempted since the step was scheduled
            drafts = sched.scheduled_spec_token_ids.get(rid, ())
            tokens, token_logprobs = _step_tokens(out, rid)
            num_rejected = len(drafts) - (len(tokens) - 1 if tokens is not None else 0)
            req.num_computed_tokens += sched.num_scheduled_tokens[rid] - num_rejected
            if rid in out.prompt_logprobs:
                req.add_prompt_logprobs(*out.prompt_logprobs[rid])
            if tokens is None:
                continue
            assert req.num_computed_tokens == req.num_tokens + len(tokens) - 1, (
                f"{rid}: {len(tokens)} tokens with {req.num_computed_tokens} of "
                f"{req.num_tokens} computed"
            )
            if drafts:
                assert self.spec is not None
                self.spec.on_verified(req, len(drafts), len(tokens) - 1)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            new_tokens, error = self._append_tokens(req, tokens, token_logprobs)
            if req.is_finished():
                stopped.add(rid)
                # Tokens past a stop were computed but are not the request's.
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            else:
                req.spec_token_ids = out.draft_token_ids.get(rid, [])
            new_logprobs = token_logprobs[: len(new_tokens)] if token_logprobs else None
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=new_tokens,
                    new_logprobs=new_logprobs,
                    prompt_logprobs=req.take_prompt_logprobs(),
                    finish_reason=req.get_finish_reason(),
                    stop_reason=req.stop_reason,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    error=error,
                )
            )
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
            for rid in stopped:
                self._finish_request(self.requests[rid])
        self._update_transfers(finished_recving, finished_sending)
        return outputs

    def _append_tokens(
        self, req: Request, tokens: list[int], logprobs: list | None
    ) -> tuple[list[int], RequestError | None]:
        """Append a step's tokens one by one, each through the grammar and the stop rule;
        the first one that finishes the request ends the run (the rest is dropped).

        Returns:
            (the tokens appended, the grammar's error when it failed the request).
        """
        for i, token in enumerate(tokens):
            req.append_output_token(token, logprobs[i] if logprobs else None)
            error = None
            if req.structured_output is not None:
                error = self._advance_grammar(req, token)
            if error is not None:
                req.status = RequestStatus.FINISHED_ABORTED
                return tokens[: i + 1], error
            if self.structured_output is not None and self.structured_output.is_terminated(req):
                # The grammar is complete (its stop token, EOS, was accepted).
                req.status = RequestStatus.FINISHED_STOPPED
                return tokens[: i + 1], None
            if self._check_stop(req):
                return tokens[: i + 1], None
        return tokens, None

    def _advance_grammar(self, req: Request, token: int) -> RequestError | None:
        """Advance the request's matcher by ``token``; the error that fails the request
        when the grammar rejects it (a token sampled under the mask is always allowed,
        unless every token was masked, e.g. by ``min_tokens`` banning the grammar's EOS)."""
        assert self.structured_output is not None
        if self.structured_output.accept(req, token):
            return None
        return RequestError(
            "structured_outputs",
            f"structured_outputs: sampled token {token} is not allowed by the grammar "
            "(no allowed token was left: check min_tokens, logit_bias, stop_token_ids)",
        )

    def _check_stop(self, req: Request) -> bool:
        stop = check_stop(req, self.max_seq_len)
        if stop is None:
            if req.prefill_only:
                # Token 1 does not end it: the engine's part is done, the decode goes on
                # elsewhere. The real params decided that, so min_tokens holds as is.
                req.status = RequestStatus.FINISHED_PREFILL_DONE
                return True
            return False
        req.status = stop.status
        if stop.stop_reason is not None:
            req.stop_reason = stop.stop_reason
        return True

    def _update_transfers(
        self, finished_recving: Mapping[str, int] | Iterable[str], finished_sending: Iterable[str]
    ) -> None:
        if isinstance(finished_recving, Mapping):
            recving: dict[str, int | None] = dict(finished_recving)
        else:
            recving = dict.fromkeys(finished_recving)
        for rid, num_loaded in recving.items():
            if rid in self._pending_free:
                self.kv_cache_manager.free(self._pending_free.pop(rid))
                continue
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                self._finish_remote_load(req, num_loaded)
        for rid in finished_sending:
            pending = self._pending_free.pop(rid, None)
            if pending is not None:
                self.kv_cache_manager.free(pending)

    def _finish_remote_load(self, req: Request, reported: int | None) -> None:
        rid = req.request_id
        requested = self._remote_requested.pop(rid)
        loaded = requested if reported is None else max(0, min(reported, requested))
        if loaded < requested:
            self.num_kv_load_failures += 1
            logger.info("%s: remote KV load got %d of %d tokens", rid, loaded, requested)
        req.num_computed_tokens += loaded
        self.connector_prefix_cache_stats.hits += loaded
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.WAITING

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (a stop string matched, a client went away).

        Unknown or already finished ids are ignored. Blocks are freed at once
        unless the connector keeps them for an in-flight transfer.

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        from_waiting: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                from_waiting.append(req)
            req.status = status
            self._finish_request(req)
        self.waiting.remove_many(from_waiting)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests at any stage (status FINISHED_ABORTED); frees their blocks."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _finish_request(self, req: Request) -> None:
        rid = req.request_id
        del self.requests[rid]
        self._arrival_seq.pop(rid, None)
        self._remote_requested.pop(rid, None)
        self._waiting_for_grammar.pop(rid, None)
        if self.structured_output is not None:
            self.structured_output.free(req)
        self.finished_req_ids.add(rid)
        if self.batches.keep_until_landed(req):
            # A batch in flight still writes its blocks: they are freed (or handed to
            # the connector) once that batch is applied (BatchesInFlight.land).
            return
        self._free_blocks(req)

    def _free_blocks(self, req: Request) -> None:
        """Free a finished request's blocks, or keep them for the connector's save."""
        rid = req.request_id
        kvm = self.kv_cache_manager
        if self.connector is not None and self.connector.request_finished(
            req, kvm.get_block_ids(rid)
        ):
            self._pending_free[rid] = req
        else:
            kvm.free(req)


def _step_tokens(out: ModelRunnerOutput, rid: str) -> tuple[list[int] | None, list | None]:
    """The tokens a step emitted for request ``rid`` and their logprobs: the verified
    ones (target token after accepted drafts) with speculative decoding, else the one
    sampled token; ``(None, None)`` when the step did not sample it (a prefill chunk)."""
    tokens: list[int] | None = out.verified_token_ids.get(rid)
    if tokens is not None:
        return tokens, out.verified_logprobs.get(rid)
    token = out.sampled_token_ids.get(rid)
    if token is None:
        return None, None
    logprobs = out.logprobs.get(rid)
    return [token], [logprobs] if logprobs is not None else None
