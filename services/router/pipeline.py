"""One request through the cluster: admission, Prefill then Decode (or a colocated engine),
retries, incremental detokenization, stop strings, usage and metrics.

Flow of one completion (``n`` completions run as ``n`` such flows, concurrently):

1. Admission: at most ``max_running`` requests past the router at once and at most
   ``max_waiting`` queued behind them; beyond that a 503 with ``Retry-After`` (bounded
   memory under overload).
2. Disaggregated: ``Prefill`` on a prefill instance chosen by the routing policy; a
   failure (instance down, internal error) is retried on another prefill instance. The
   prefill answers as soon as its first token is sampled (its KV publish may still run:
   ``kv_publish_pending``, passed on to the decode side, which waits for those blocks).
   The first token is emitted at once (that is the TTFT), then ``Decode`` on a decode
   instance with the prefill's block hashes. A Decode that fails before it produced any token is
   retried on another decode instance (the first token is fixed by prefill, so this is
   safe for any sampling). One that fails after it streamed tokens is migrated (up to
   ``max_migrations`` times, as Dynamo's request migration): another decode instance gets
   the prompt plus every token passed on so far (``output_token_ids``), computes their KV
   (loading what the store holds) and streams the tokens after them, so the client sees
   one stream; a seeded request continues its random stream, since engines key seeded
   draws by output position. Only when no instance is left does the stream end with an
   ``instance_failed`` error.
   Colocated: one ``Decode`` without first token on a ``both`` instance, same rules.
   Conditional disaggregation: the decode instance is chosen first; when the prompt's
   uncached part there (after its local prefix-cache hit, or the store's, whichever is
   longer: ``CacheView``) is below ``disagg_min_uncached_tokens``, the Prefill hop is
   skipped and that decode instance gets the colocated form (it prefills the rest itself,
   loading the stored part); so is it when the least loaded prefill instance already has
   ``disagg_max_prefill_queue`` prefills outstanding (a burst the prefill instances cannot
   take at once is shared with the decode instances). Prefill fallback (on unless
   ``disagg_prefill_fallback`` is off; Dynamo's decode-only fallback): when no prefill
   instance is up (none in the view, or every one failed its last load poll) or every
   Prefill attempt failed because the instance was unavailable or full (UNAVAILABLE,
   RESOURCE_EXHAUSTED; not INTERNAL: a request that broke prefill engines is not
   replayed on decode ones), a decode instance prefills the prompt itself, so losing
   the prefill tier slows first tokens instead of failing requests. An instance benched
   after one failed call is still tried when no other is left (as without the
   fallback): one failure does not send every prompt to the decode instances.
   The choice and its reason go into ``timings`` (``disagg_decision``, ``disagg_reason``)
   and ``tandem:router_disagg_decision_total{path}``, once per completion, for the path taken.
3. Each token batch goes through ``engine.detokenizer.IncrementalDetokenizer``; when a stop
   string matches, the decode stream is cancelled (the engine aborts and frees its blocks).
4. The consumer closing the iterator (client disconnect) cancels every RPC in flight.

Errors are ``OpenAIError``: 400 for the caller's mistakes (the engine's INVALID_ARGUMENT),
503 when no instance could serve; the HTTP layer turns a failure after streaming began
into an error event.

The Decode stage (its retries and migration) is ``decode_stage.DecodeStage``, and the
choice of instances to try and the errors in the client's words ``retries.Retries``;
both are bases of ``Pipeline``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from tandem.contracts.proto import publish_in_flight_to_proto, sampling_params_to_proto
from tandem.contracts.role import Role
from tandem.contracts.tracing import TRACING_OFF, Tracing
from tandem.engine.fan_out import fan_out
from tandem.engine.sampling_params import SamplingParams
from tandem.services.router.client import InstancePool
from tandem.services.router.decode_stage import DecodeStage
from tandem.services.router.discovery import Discovery, InstanceInfo
from tandem.services.router.errors import OpenAIError
from tandem.services.router.merge import merge_streams
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.publishes import PublishTracker
from tandem.services.router.request_trace import RequestTrace, SeqTrace, end_call
from tandem.services.router.retries import (
    PREFILL_FALLBACK_CODES,
    raise_if_caller_error,
    unavailable_error,
)
from tandem.services.router.routing import CacheView, KVAwareRouter, RouteContext, Router
from tandem.services.router.sequence import (
    GenerationRequest,
    SeqDelta,
    SeqState,
    Timings,
)
from tandem.v1 import decode_pb2, prefill_pb2

logger = logging.getLogger(__name__)


class _Admission:
    """Bounded admission: ``max_running`` concurrent, ``max_waiting`` queued, else 503."""

    def __init__(self, max_running: int, max_waiting: int, metrics: RouterMetrics) -> None:
        self._sem = asyncio.Semaphore(max_running)
        self._max_waiting = max_waiting
        self.num_waiting = 0
        self.num_running = 0
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        if self._sem.locked() and self.num_waiting >= self._max_waiting:
            raise OpenAIError("the server is overloaded: request queue is full",
                              status_code=503, retry_after_s=1)
        self._set_waiting(+1)
        try:
            await self._sem.acquire()
        finally:
            self._set_waiting(-1)
        self._set_running(+1)
        try:
            yield
        finally:
            self._set_running(-1)
            self._sem.release()

    def _set_waiting(self, d: int) -> None:
        self.num_waiting += d
        self._metrics.labels(self._metrics.num_waiting).set(self.num_waiting)

    def _set_running(self, d: int) -> None:
        self.num_running += d
        self._metrics.labels(self._metrics.num_running).set(self.num_running)


class Pipeline(DecodeStage):
    """Runs requests through the instances. One per router; safe for concurrent use.

    Args:
        tokenizer: HF tokenizer of the served model (detokenization).
        discovery: instance source.
        pool: gRPC channels to instances.
        router: routing strategy.
        metrics: the router's Prometheus series.
        max_running / max_waiting: admission bounds (requests).
        max_attempts: tries per stage (first call included).
        max_migrations: times one completion may move to another instance mid-stream.
        cache_view: where prompts' KV lies (the kv_aware router's view when ``router`` is
            one, else this or a view without a store).
        disagg_min_uncached_tokens: in disaggregated mode, a prompt with fewer uncached
            tokens than this on the chosen decode instance skips the prefill hop (0: never).
        disagg_max_prefill_queue: in disaggregated mode, when the least loaded prefill
            instance has this many prefills outstanding (``InstanceInfo.load``: its last
            report or this router's in-flight count, the larger), the chosen decode
            instance prefills the prompt itself (0: never). Dynamo's disaggregated
            router decides the same way (``max_prefill_queue_size``).
        disagg_prefill_fallback: with decode instances up but no prefill instance that
            can serve (none up, or every Prefill attempt failed with UNAVAILABLE or
            RESOURCE_EXHAUSTED), a decode instance prefills the prompt itself instead of
            the request failing with a 503.
        tracing: the router's OpenTelemetry tracing (``request_trace.py``; off: no span
            work at all).

    Raises:
        ValueError: a negative threshold.
    """

    def __init__(self, *, tokenizer: Any, discovery: Discovery, pool: InstancePool,
                 router: Router, metrics: RouterMetrics, max_running: int = 256,
                 max_waiting: int = 1024, max_attempts: int = 3, max_migrations: int = 3,
                 cache_view: CacheView | None = None,
                 disagg_min_uncached_tokens: int = 0,
                 disagg_max_prefill_queue: int = 0,
                 disagg_prefill_fallback: bool = True, tracing: Tracing = TRACING_OFF
                 ) -> None:
        for name, value in (("disagg_min_uncached_tokens", disagg_min_uncached_tokens),
                            ("disagg_max_prefill_queue", disagg_max_prefill_queue)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if isinstance(router, KVAwareRouter):
            cache_view = router.view
        self.cache_view = cache_view if cache_view is not None else CacheView()
        self.disagg_min_uncached_tokens = disagg_min_uncached_tokens
        self.disagg_max_prefill_queue = disagg_max_prefill_queue
        self.disagg_prefill_fallback = disagg_prefill_fallback
        self.tokenizer = tokenizer
        self.discovery = discovery
        self.pool = pool
        self.router = router
        self.metrics = metrics
        self.admission = _Admission(max_running, max_waiting, metrics)
        self.max_attempts = max_attempts
        self.max_migrations = max_migrations
        self.publishes = PublishTracker()
        self.tracing = tracing

    def mode(self) -> str:
        """"disagg" when prefill and decode instances exist, else "colocated" when
        colocated ones do, else "disagg" when decode instances exist and the prefill
        fallback is on (they prefill themselves).

        Raises:
            OpenAIError: 503 when no instance can serve at all.
        """
        decode = self.discovery.instances(Role.DECODE)
        if decode and self.discovery.instances(Role.PREFILL):
            return "disagg"
        if self.discovery.instances(Role.BOTH):
            return "colocated"
        if decode and self.disagg_prefill_fallback:
            return "disagg"
        raise OpenAIError("no healthy engine instance is available", status_code=503,
                          retry_after_s=1)

    def can_prefill_locally(self) -> bool:
        """No prefill instance is up and live decode instances prefill prompts themselves
        (readiness; a prefill instance not polled yet counts as up)."""
        return (self.disagg_prefill_fallback and self.discovery.has_live(Role.DECODE)
                and not self._prefill_up())

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[SeqDelta, None]:
        """Deltas of all ``n`` completions, in the order they are produced.

        Raises:
            OpenAIError: 503 overloaded / no instance, 400 rejected by the engine, 503 an
                instance failed after this completion's tokens were already produced.
        """
        rtrace = (RequestTrace(self.tracing, req.trace_parent, req.request_id, req.arrival_ns,
                               len(req.prompt_token_ids)) if self.tracing.enabled else None)
        error: BaseException | None = None
        try:
            async with self.admission.slot():
                router_queue_ns = time.monotonic_ns() - req.arrival_ns
                if rtrace is not None:
                    rtrace.admitted(req.arrival_ns + router_queue_ns)
                self.mode()  # fail fast (503) before any RPC
                m = self.metrics
                m.labels(m.prompt_tokens).inc(len(req.prompt_token_ids))
                children = fan_out(req.request_id, req.sampling_params)
                streams = [
                    self._run_seq(c.index, req, c.sampling_params, c.request_id,
                                  router_queue_ns,
                                  rtrace.seq(c.index) if rtrace is not None else None)
                    for c in children
                ]
                # NOTE: closed explicitly, so a client going away cancels every RPC before
                # the admission slot is given back (not later, when the generator is
                # collected).
                async with contextlib.aclosing(merge_streams(streams)) as deltas:
                    async for d in deltas:
                        yield d
        except BaseException as exc:
            error = exc
            raise
        finally:
            if rtrace is not None:
                rtrace.end(error)

    async def _run_seq(self, index: int, req: GenerationRequest, sp: SamplingParams,
                       seq_id: str, router_queue_ns: int, trace: SeqTrace | None = None
                       ) -> AsyncGenerator[SeqDelta, None]:
        mode = self.mode()
        timings = Timings(router_queue_ns=router_queue_ns)
        state = SeqState(self.tokenizer, self.metrics, index, req, sp, timings)
        psp = sampling_params_to_proto(sp)
        metadata = (("x-request-id", seq_id),)
        route = RouteContext(Role.PREFILL, req.prompt_token_ids, seq_id,
                             cache_salt=req.cache_salt)
        decode_first: InstanceInfo | None = None
        local_prefill = False
        hint = None
        if mode == "disagg":
            decode_first, local_prefill = await self._disagg_decision(route, timings, trace)
            # a chat's next turn: the previous answer's blocks may still be publishing
            found = self.publishes.find(route.block_hashes, self.discovery.is_down)
            if found is not None:
                hint = publish_in_flight_to_proto(found)
                self.metrics.labels(self.metrics.kv_publish_hints).inc()
        presp = None
        try:
            if mode == "disagg" and not local_prefill:
                presp = await self._prefill(route, prefill_pb2.PrefillRequest(
                    request_id=seq_id, prompt_token_ids=req.prompt_token_ids,
                    sampling_params=psp, priority=req.priority, kv_publish_in_flight=hint,
                    cache_salt=req.cache_salt or ""),
                    metadata, timings, req.param_of_field, trace)
                local_prefill = presp is None
        finally:
            if trace is not None:
                trace.decision(timings.disagg_decision, timings.disagg_reason)
            # a prefill that ended the request (400, 503) took its path all the same
            if mode == "disagg":
                m = self.metrics
                m.disagg_decision.labels(model_name=m.model_name,
                                         path=timings.disagg_decision).inc()
        if presp is not None:
            state.num_cached_tokens = timings.cached_tokens = presp.num_cached_tokens
            state.prompt_logprobs = list(presp.prompt_logprobs) or None
            lps = [presp.first_logprobs] if presp.HasField("first_logprobs") else None
            stop_tok = presp.stop_token_id if presp.HasField("stop_token_id") else None
            delta = state.add([presp.first_token_id], lps, presp.finish_reason, stop_tok)
            if delta is not None:
                yield delta
            if state.finished:
                return
            dreq = decode_pb2.DecodeRequest(
                request_id=seq_id, prompt_token_ids=req.prompt_token_ids,
                first_token_id=presp.first_token_id, block_hashes=presp.block_hashes,
                sampling_params=psp, kv_layout_fingerprint=presp.kv_layout_fingerprint,
                hash_algorithm=presp.hash_algorithm, priority=req.priority,
                kv_publish_pending=presp.kv_publish_pending, cache_salt=req.cache_salt or "")
            stage = Role.DECODE
        else:
            # colocated, or a decode instance's local prefill: no first token
            dreq = decode_pb2.DecodeRequest(
                request_id=seq_id, prompt_token_ids=req.prompt_token_ids,
                sampling_params=psp, priority=req.priority, kv_publish_in_flight=hint,
                cache_salt=req.cache_salt or "")
            stage = Role.DECODE if local_prefill else Role.BOTH
        ctx = route.for_stage(stage)
        async for delta in self._decode(ctx, dreq, state, req.param_of_field, decode_first,
                                        trace):
            yield delta

    async def _disagg_decision(self, route: RouteContext, timings: Timings,
                               trace: SeqTrace | None = None
                               ) -> tuple[InstanceInfo | None, bool]:
        """(the decode instance to try first, whether it prefills the prompt itself), and
        ``timings.disagg_decision`` / ``disagg_reason`` set to match.

        With no prefill instance up and the fallback on: a local prefill. Else, with both
        ``disagg_min_uncached_tokens`` and ``disagg_max_prefill_queue`` off, (``None``,
        False): the decode instance is chosen after the prefill, as always."""
        if self.disagg_prefill_fallback and not self._prefill_up():
            timings.disagg_decision = "local_prefill"
            timings.disagg_reason = "no prefill instance is up"
            return None, True
        threshold = self.disagg_min_uncached_tokens
        max_queue = self.disagg_max_prefill_queue
        on = bool(threshold or max_queue)
        cands = self.discovery.instances(Role.DECODE) if on else []
        if not cands:
            timings.disagg_decision = "remote_prefill"
            timings.disagg_reason = "conditional disaggregation off" if not on \
                else "no decode instance to choose yet"
            return None, False
        ctx = route.for_stage(Role.DECODE)
        info = await self.choose(cands, ctx, trace)
        reasons = []
        local = False
        if threshold:
            est = await self.cache_view.estimate(info, ctx)
            uncached = len(route.prompt_token_ids) - est.reused_tokens
            local = uncached < threshold
            reasons.append(
                f"{uncached} uncached tokens {'<' if local else '>='} {threshold} "
                f"(decode instance cache {est.local_tokens}, store {est.store_tokens})")
        if max_queue and not local:
            queue = min((p.load for p in self.discovery.instances(Role.PREFILL)), default=0)
            local = queue >= max_queue
            reasons.append(f"prefill queue {queue} {'>=' if local else '<'} {max_queue}")
        timings.disagg_decision = "local_prefill" if local else "remote_prefill"
        timings.disagg_reason = "; ".join(reasons)
        return info, local

    def _prefill_up(self) -> bool:
        """Some prefill instance is in the view and did not fail its last load poll."""
        return any(p.alive is not False for p in self.discovery.instances(Role.PREFILL))

    async def _prefill(self, ctx: RouteContext, preq: prefill_pb2.PrefillRequest,
                       metadata: Sequence[tuple[str, str]], timings: Timings,
                       param_of_field: Mapping[str, str], trace: SeqTrace | None = None
                       ) -> prefill_pb2.PrefillResponse | None:
        """The Prefill answer of the first prefill instance that gives one, or ``None``
        when none could and the prefill fallback is on (``timings`` then names a local
        prefill and why).

        Raises:
            OpenAIError: 400 the engine rejected the request; 503 no prefill instance
                could serve and the fallback is off.
        """
        last: grpc.aio.AioRpcError | None = None
        async for info in self._attempts(Role.PREFILL, ctx, trace=trace):
            self.discovery.acquire(info.address)
            span = None
            call_metadata = tuple(metadata)
            if trace is not None:
                span = trace.call("tandem.prefill", info.address)
                call_metadata += tuple(trace.headers(span).items())
            error: BaseException | None = None
            try:
                with self.metrics.scaling.prefill_in_flight(len(preq.prompt_token_ids)):
                    presp = await self.pool.prefill(info.address, preq, call_metadata)
            except grpc.aio.AioRpcError as exc:
                error = exc
                raise_if_caller_error(exc, param_of_field)
                last = exc
                self._failed(info, Role.PREFILL, exc)
                continue
            finally:
                self.discovery.release(info.address)
                if span is not None:
                    end_call(span, error)
            self.discovery.mark_ok(info.address)
            self.router.on_routed(info, ctx)
            timings.prefill_instance = info.address
            timings.prefill_queue_ns = presp.queue_ns
            timings.prefill_compute_ns = presp.compute_ns
            timings.kv_publish_ns = presp.publish_ns
            return presp
        if not self.disagg_prefill_fallback or (
                last is not None and last.code() not in PREFILL_FALLBACK_CODES):
            raise unavailable_error(Role.PREFILL, last, param_of_field)
        why = f"{last.code().name} {last.details()}" if last is not None else "none left"
        logger.warning("no prefill instance could serve %s (%s): the decode instance "
                       "prefills it", preq.request_id, why)
        timings.disagg_decision = "local_prefill"
        timings.disagg_reason = f"every prefill attempt failed ({why})"
        return None
