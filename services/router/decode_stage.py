"""The Decode stage of one completion: a call that fails before it produced a token is
retried on another instance; one that fails after is migrated (the tokens passed on so
far go to another instance, which streams the tokens after them), so the client sees
one stream (``Pipeline``'s base, after ``Retries``).

Each Decode call's messages become ``SeqDelta``s through the completion's ``SeqState``;
the first message carries the KV handoff's timings (and, for a colocated or local
prefill, the prefill's), and a finished request on an instance that publishes its output
is remembered for the next turn's publish hint (``PublishTracker``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping

import grpc

from tandem.services.router.client import InstancePool
from tandem.services.router.discovery import InstanceInfo
from tandem.services.router.errors import OpenAIError
from tandem.services.router.publishes import PublishTracker
from tandem.services.router.request_trace import SeqTrace, StreamTimes, end_call
from tandem.services.router.retries import Retries, raise_if_caller_error, unavailable_error
from tandem.services.router.routing import RouteContext
from tandem.services.router.sequence import EngineAbort, SeqDelta, SeqState
from tandem.v1 import decode_pb2

logger = logging.getLogger(__name__)


class DecodeStage(Retries):
    """Decode calls with retries and migration (see the module docstring).

    Not constructed on its own: ``Pipeline`` sets every attribute declared here.
    """

    pool: InstancePool
    publishes: PublishTracker
    max_migrations: int

    async def _decode(self, ctx: RouteContext, dreq: decode_pb2.DecodeRequest,
                      state: SeqState, param_of_field: Mapping[str, str], first: InstanceInfo | None = None,
                      trace: SeqTrace | None = None) -> AsyncIterator[SeqDelta]:
        """Stream the completion from ``ctx.stage`` instances: a call that fails before it
        produced a token is retried elsewhere with the same request; one that fails after
        is migrated (at most ``max_migrations`` times): the colocated form with the tokens
        passed on so far as ``output_token_ids``, to an instance not tried yet, which
        streams the tokens after them.

        Raises:
            OpenAIError: 400 the engine rejected the request; 503 no instance could serve,
                or one failed mid-stream with no migration left (``instance_failed``).
        """
        tried: set[str] = set()
        migrations = 0
        while True:
            failure = None
            async for info in self._attempts(ctx.stage, ctx, first, tried, trace):
                first = None
                failure = None
                # NOTE: closed explicitly: a client going away must cancel the call now.
                async with contextlib.aclosing(self._decode_on(
                        info, ctx, dreq, state, param_of_field, migrations > 0, trace)
                        ) as deltas:
                    async for delta in deltas:
                        if isinstance(delta, _MidStreamFailure):
                            failure = delta
                        else:
                            yield delta
                if failure is None:
                    return
                if failure.num_emitted:
                    break
            if failure is None or not failure.num_emitted:
                last = failure.error if failure is not None else None
                if migrations:
                    raise OpenAIError(
                        f"no {ctx.stage} instance was left to continue the request after "
                        f"{migrations} migration(s)", status_code=503, code="instance_failed")
                raise unavailable_error(ctx.stage, last, param_of_field)
            if migrations >= self.max_migrations:
                raise OpenAIError(f"{failure.message} (after {migrations} migration(s))",
                                  status_code=503, code="instance_failed")
            migrations += 1
            state.timings.num_migrations = migrations
            m = self.metrics
            m.labels(m.migrations).inc()
            logger.warning("migrating %s after %d tokens: %s", dreq.request_id,
                           state.num_tokens, failure.message)
            dreq = decode_pb2.DecodeRequest(
                request_id=dreq.request_id, prompt_token_ids=dreq.prompt_token_ids,
                output_token_ids=state.output_token_ids, sampling_params=dreq.sampling_params,
                priority=dreq.priority, cache_salt=dreq.cache_salt)

    async def _decode_on(self, info: InstanceInfo, ctx: RouteContext,
                         dreq: decode_pb2.DecodeRequest, state: SeqState,
                         param_of_field: Mapping[str, str], resumed: bool,
                         trace: SeqTrace | None = None
                         ) -> AsyncGenerator[SeqDelta | _MidStreamFailure, None]:
        """One decode stream on ``info``: its deltas, then a ``_MidStreamFailure`` last if the
        instance failed (a caller error raises instead)."""
        colocated_form = not dreq.HasField("first_token_id")
        state.timings.decode_instance = info.address
        if colocated_form and not resumed:
            state.timings.prefill_instance = info.address
        timings = state.timings
        num_emitted = 0
        num_messages = 0
        call = None
        span = times = None
        error: BaseException | None = None
        if trace is not None:
            span, times = trace.call("tandem.decode_stream", info.address), StreamTimes()
            dreq.trace_context.clear()
            dreq.trace_context.update(trace.headers(span))
        self.discovery.acquire(info.address)
        try:
            call = self.pool.decode(info.address, dreq)
            start_ns = time.monotonic_ns()
            async for msg in call:
                if num_messages == 0:
                    self._first_decode_message(msg, state, start_ns, info, ctx,
                                               colocated_form and not resumed)
                num_messages += 1
                if not msg.token_ids and not msg.finish_reason:
                    continue
                recv_ns = time.monotonic_ns() if times is not None else 0
                stop_tok = msg.stop_token_id if msg.HasField("stop_token_id") else None
                token_ids = list(msg.token_ids)
                if msg.prompt_logprobs:  # a colocated or local prefill computed the prompt
                    state.prompt_logprobs = list(msg.prompt_logprobs)
                delta = state.add(token_ids, list(msg.logprobs) or None,
                                  msg.finish_reason, stop_tok)
                num_emitted += len(token_ids)
                if state.finished and info.kv_publish_output:
                    # before the last delta goes out: the next turn can come right after
                    self._remember_publish(info, ctx, dreq.request_id, state, colocated_form)
                timings.decode_tokens = (timings.decode_tokens or 0) + len(token_ids)
                if times is not None:
                    times.add(len(token_ids), recv_ns, time.monotonic_ns())
                if delta is not None:
                    yield delta
                if state.finished:
                    return
            self.discovery.mark_failed(info.address)
            yield _MidStreamFailure(num_emitted, f"decode stream from {info.address} ended "
                                    "unfinished")
        except grpc.aio.AioRpcError as exc:
            error = exc
            raise_if_caller_error(exc, param_of_field)
            self._failed(info, ctx.stage, exc)
            yield _MidStreamFailure(num_emitted, f"decode instance {info.address} failed "
                                    f"mid-stream: {exc.details()}", exc)
        except EngineAbort as exc:
            error = exc
            self.discovery.mark_failed(info.address)
            yield _MidStreamFailure(num_emitted, f"{info.address}: {exc}")
        finally:
            # Stop string matched, client gone, or error: abort on the engine.
            if call is not None:
                if not call.done():
                    logger.debug("cancelling decode of %s on %s", dreq.request_id,
                                 info.address)
                call.cancel()
            self.discovery.release(info.address)
            if span is not None and times is not None:
                end_call(span, error, times.attributes())

    def _remember_publish(self, info: InstanceInfo, ctx: RouteContext, request_id: str,
                          state: SeqState, colocated_form: bool) -> None:
        """Note the output publish ``info`` starts for a finished request (the prompt +
        every output token but the last have KV there) for the next turn's hint."""
        bs = info.block_size
        tokens = [*ctx.prompt_token_ids, *state.output_token_ids[:-1]]
        # the prefill published the prompt's full blocks; a colocated form computed them
        first = 0 if colocated_form else len(ctx.prompt_token_ids) // bs
        self.publishes.record(request_id, info.address, info.kv_layout_fingerprint, bs,
                              ctx.block_hashes(bs), tokens, first)

    def _first_decode_message(self, msg: decode_pb2.DecodeResponse, state: SeqState,
                              start_ns: int, info: InstanceInfo, ctx: RouteContext,
                              colocated_form: bool) -> None:
        self.discovery.mark_ok(info.address)
        self.router.on_routed(info, ctx)
        t = state.timings
        t.first_decode_ns = time.monotonic_ns() - start_ns
        if msg.HasField("kv_pull_ns"):
            t.kv_pull_ns = msg.kv_pull_ns
        if msg.HasField("queue_ns"):
            t.decode_queue_ns = msg.queue_ns
            if colocated_form:
                # Colocated: the first message carries the first token, so everything after
                # the engine's queue up to it is prefill compute (RPC overhead included).
                t.prefill_queue_ns = msg.queue_ns
                t.prefill_compute_ns = max(0, t.first_decode_ns - msg.queue_ns)
        if msg.HasField("num_cached_tokens") and colocated_form:
            state.num_cached_tokens = t.cached_tokens = msg.num_cached_tokens
        m = self.metrics
        if not colocated_form and t.kv_pull_ns is not None:
            handoff_s = ((t.kv_publish_ns or 0) + t.kv_pull_ns) / 1e9
            m.labels(m.kv_handoff_seconds).observe(handoff_s)
            if msg.HasField("kv_pull_bytes"):
                # what the decode engine pulled from the store, as it reports it
                # (not blocks it already held, and in the dtype it runs)
                m.labels(m.kv_handoff_bytes).inc(msg.kv_pull_bytes)


@dataclasses.dataclass(frozen=True)
class _MidStreamFailure:
    """An instance failed a Decode call after ``num_emitted`` of its tokens went out."""

    num_emitted: int
    message: str
    error: grpc.aio.AioRpcError | None = None
