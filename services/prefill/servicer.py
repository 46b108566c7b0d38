"""PrefillService: compute a prompt, sample its first token, publish its KV blocks.

The engine request carries the caller's sampling params with ``prefill_only`` set:
the scheduler batches it with other prompts (chunked, prefix cached) and ends it
after token 1, reporting in the output's finish reason whether token 1 ends the
request ("stop"/"length", decided once by the engine's stop rule) or not
("prefill_done": the decode service goes on). When it finishes, the
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
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request, RequestStatus
from tandem.services.common.context import ServiceContext, now_ns
from tandem.services.common.engine_spans import (
    end_span,
    record_publish,
    record_pull,
    record_schedule,
    request_span,
)
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

_PREFILL_DONE = RequestStatus.finish_reason(RequestStatus.FINISHED_PREFILL_DONE)


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
        req.prefill_only = True
        span = request_span(
            ctx.tracing, "tandem.prefill", context.invocation_metadata(), req, arrival_ns
        )
        if request.HasField("kv_publish_in_flight"):
            req.kv_publish_in_flight = publish_in_flight_from_proto(request.kv_publish_in_flight)
        await ctx.check_structured_outputs(req)
        saved = ctx.transfers.expect_save(req.request_id) if ctx.transfers else None
        first, token_ns = await self._first_token(req)
        pending = self._settle_transfers(req, saved, first, token_ns, span, arrival_ns)
        reason = _final_reason(first)
        resp = self._response(req, first, reason, arrival_ns, token_ns)
        resp.publish_ns = _publish_ns(saved, token_ns) if not pending else 0
        resp.kv_publish_pending = pending
        m = ctx.metrics
        m.labels(m.time_to_first_token).observe((token_ns - arrival_ns) / 1e9)
        record_schedule(
            ctx.tracing,
            span,
            req,
            arrival_ns,
            token_ns,
            "tandem.prefill_queue",
            "tandem.prefill_compute",
        )
        end_span(span, reason, 1)
        return resp

    async def _first_token(self, req: Request) -> tuple[EngineCoreOutput, int]:
        """Run the ``prefill_only`` request through the engine: (the output with its
        token 1, the monotonic ns it came out). A failure drops its expected save."""
        ctx = self._ctx
        try:
            first = None
            async with await ctx.engine_loop.add_request(req) as stream:
                async for out in stream:
                    if out.new_token_ids and first is None:
                        first = out
            assert first is not None, "prefill finished without a token"
            return first, stream.first_output_ns or now_ns()
        except BaseException:
            if ctx.transfers is not None:
                ctx.transfers.forget(req.request_id)
            raise

    def _settle_transfers(
        self,
        req: Request,
        saved: asyncio.Future[SaveResult] | None,
        first: EngineCoreOutput,
        token_ns: int,
        span: trace.Span | None,
        arrival_ns: int,
    ) -> bool:
        """Take the request's load result and hook its publish; whether the publish is
        still running (an aborted request publishes nothing; otherwise the publish ends
        on its own)."""
        transfers = self._ctx.transfers
        if transfers is None:
            return False
        # the stored prefix it loaded (if any): taken here, or it would stay in the
        # mailbox for good
        load = transfers.pop_load(req.request_id)
        if load is not None:
            record_pull(self._ctx.tracing, span, arrival_ns, load)
        if saved is None:
            return False
        if first.finish_reason == "abort":
            transfers.forget(req.request_id)
            return False
        pending = not saved.done()
        saved.add_done_callback(lambda f: self._published(f, token_ns, span))
        return pending

    def _response(
        self,
        req: Request,
        first: EngineCoreOutput,
        reason: str | None,
        arrival_ns: int,
        token_ns: int,
    ) -> prefill_pb2.PrefillResponse:
        """The response of a prefill whose token 1 is ``first`` (publish fields unset)."""
        ctx = self._ctx
        params = req.sampling_params
        token_id = first.new_token_ids[0]
        scheduled_ns = _mono_ns(req.first_scheduled_time, arrival_ns)
        resp = prefill_pb2.PrefillResponse(
            request_id=req.request_id,
            first_token_id=token_id,
            finish_reason=finish_reason_to_proto(reason),
            block_hashes=prompt_block_hashes(
                req.prompt_token_ids, ctx.block_size, cache_salt=req.cache_salt
            ),
            kv_layout_fingerprint=ctx.kv_layout_fingerprint,
            hash_algorithm=ctx.hash_algorithm,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            queue_ns=max(scheduled_ns - arrival_ns, 0),
            compute_ns=max(token_ns - scheduled_ns, 0),
        )
        if first.new_logprobs and params.logprobs is not None:
            resp.first_logprobs.CopyFrom(
                logprobs_to_proto(token_id, first.new_logprobs[0], params.logprobs)
            )
        if first.prompt_logprobs is not None and params.prompt_logprobs is not None:
            resp.prompt_logprobs.extend(
                prompt_logprobs_to_proto(
                    req.prompt_token_ids, first.prompt_logprobs, params.prompt_logprobs
                )
            )
        if isinstance(first.stop_reason, int):
            resp.stop_token_id = first.stop_reason
        return resp

    def _published(
        self, saved: asyncio.Future[SaveResult], token_ns: int, span: trace.Span | None
    ) -> None:
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


def _final_reason(first: EngineCoreOutput) -> str | None:
    """The request's finish reason after token 1, as the engine decided it against the
    caller's params: "stop", "length" or "abort", or ``None`` ("prefill_done": token 1
    does not end it, the decode goes on)."""
    return None if first.finish_reason == _PREFILL_DONE else first.finish_reason


def _publish_ns(saved: asyncio.Future[SaveResult] | None, token_ns: int) -> int:
    """First token -> the publish ended, ns (0 when nothing was published or not yet)."""
    if saved is None or not saved.done() or saved.cancelled():
        return 0
    return max(saved.result().done_ns - token_ns, 0)


def _mono_ns(monotonic_s: float | None, default_ns: int) -> int:
    """A ``time.monotonic()`` seconds stamp in ns (``default_ns`` when unset)."""
    return default_ns if monotonic_s is None else int(monotonic_s * 1e9)
