"""PrefillService: compute a prompt, sample its first token, publish its KV blocks.

The engine request is the caller's with ``max_tokens = 1``: the scheduler
batches it with other prompts (chunked, prefix cached); when it finishes, the
KV connector publishes its blocks (full + partial last, only those the
store lacks) from a background thread and frees them once published (the
scheduler keeps them until the connector reports the save). This handler answers
as soon as the first token is out, without waiting for the publish
(``kv_publish_pending``: the decode side waits for blocks still in flight,
kvstore/arrival.py), so the publish is not part of the time to first token; the
publish's time goes to ``tandem:kv_publish_seconds`` when it ends. The prefill
engine keeps nothing for the request beyond its prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
from opentelemetry import trace

from tandem.contracts.block_hash import prompt_block_hashes
from tandem.contracts.proto import (
    finish_reason_to_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    publish_in_flight_from_proto,
)
from tandem.engine.kv_connector import SaveResult
from tandem.engine.stop import check_stop
from tandem.services.common.context import ServiceContext, now_ns
from tandem.services.common.engine_spans import (
    end_span,
    record_publish,
    record_pull,
    record_schedule,
    request_span,
)
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Thin servicer: protobuf -> engine -> protobuf. Errors map in ``common.errors``."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        ctx = self._ctx
        arrival_ns = now_ns()
        req = ctx.new_request(
            request.request_id, request.prompt_token_ids, request.sampling_params, request.priority
        )
        req.cache_salt = request.cache_salt or None
        span = request_span(ctx.tracing, "tandem.prefill", context.invocation_metadata(), req,
                            arrival_ns)
        if request.HasField("kv_publish_in_flight"):
            req.kv_publish_in_flight = publish_in_flight_from_proto(request.kv_publish_in_flight)
        await ctx.check_structured_outputs(req)
        full_params = req.sampling_params
        # The engine computes only token 1; min_tokens <= max_tokens must hold.
        req.sampling_params = dataclasses.replace(
            full_params, max_tokens=1, min_tokens=min(full_params.min_tokens, 1)
        )
        saved = ctx.transfers.expect_save(req.request_id) if ctx.transfers else None
        try:
            first = None
            async with await ctx.engine_loop.add_request(req) as stream:
                async for out in stream:
                    if out.new_token_ids and first is None:
                        first = out
            assert first is not None, "prefill finished without a token"
            token_ns = stream.first_output_ns or now_ns()
            aborted = first.finish_reason == "abort"
        except BaseException:
            if ctx.transfers is not None:
                ctx.transfers.forget(req.request_id)
            raise
        # An aborted request publishes nothing; otherwise the publish ends on its own.
        pending = False
        if ctx.transfers is not None:
            # the stored prefix it loaded (if any): taken here, or it would stay in the
            # mailbox for good
            load = ctx.transfers.pop_load(req.request_id)
            if load is not None:
                record_pull(ctx.tracing, span, arrival_ns, load)
        if saved is not None and ctx.transfers is not None:
            if aborted:
                ctx.transfers.forget(req.request_id)
            else:
                pending = not saved.done()
                saved.add_done_callback(lambda f: self._published(f, token_ns, span))
        req.sampling_params = full_params
        token_id = first.new_token_ids[0]
        reason: str | None = "abort"
        stop = None if aborted else check_stop(req, ctx.max_seq_len)
        if not aborted:
            reason = None if stop is None else stop.finish_reason
            if first.finish_reason == "stop":
                reason = "stop"  # EOS or a stop id (as above), or the grammar is complete
        scheduled_ns = _mono_ns(req.first_scheduled_time, arrival_ns)
        resp = prefill_pb2.PrefillResponse(
            request_id=req.request_id,
            first_token_id=token_id,
            finish_reason=finish_reason_to_proto(reason),
            block_hashes=prompt_block_hashes(req.prompt_token_ids, ctx.block_size,
                                             cache_salt=req.cache_salt),
            kv_layout_fingerprint=ctx.kv_layout_fingerprint,
            hash_algorithm=ctx.hash_algorithm,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            queue_ns=max(scheduled_ns - arrival_ns, 0),
            compute_ns=max(token_ns - scheduled_ns, 0),
            publish_ns=_publish_ns(saved, token_ns) if not pending else 0,
            kv_publish_pending=pending,
        )
        if first.new_logprobs and full_params.logprobs is not None:
            resp.first_logprobs.CopyFrom(
                logprobs_to_proto(token_id, first.new_logprobs[0], full_params.logprobs)
            )
        if first.prompt_logprobs is not None and full_params.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(prompt_logprobs_to_proto(
                req.prompt_token_ids, first.prompt_logprobs, full_params.prompt_logprobs))
        if stop is not None and stop.stop_reason is not None:
            resp.stop_token_id = stop.stop_reason
        m = ctx.metrics
        m.labels(m.time_to_first_token).observe((token_ns - arrival_ns) / 1e9)
        record_schedule(ctx.tracing, span, req, arrival_ns, token_ns, "tandem.prefill_queue",
                        "tandem.prefill_compute")
        end_span(span, reason, 1)
        return resp

    def _published(self, saved: asyncio.Future[SaveResult], token_ns: int,
                   span: trace.Span | None) -> None:
        """A request's publish ended (on the event loop): its time goes to the metric
        (and to a span when tracing)."""
        if saved.cancelled():
            return
        record_publish(self._ctx.tracing, span, token_ns, saved.result())
        m = self._ctx.metrics
        m.labels(m.kv_publish_seconds).observe(_publish_ns(saved, token_ns) / 1e9)

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return await self._ctx.load_response()


def _publish_ns(saved: asyncio.Future[SaveResult] | None, token_ns: int) -> int:
    """First token -> the publish ended, ns (0 when nothing was published or not yet)."""
    if saved is None or not saved.done() or saved.cancelled():
        return 0
    return max(saved.result().done_ns - token_ns, 0)


def _mono_ns(monotonic_s: float | None, default_ns: int) -> int:
    """A ``time.monotonic()`` seconds stamp in ns (``default_ns`` when unset)."""
    return default_ns if monotonic_s is None else int(monotonic_s * 1e9)
