"""PrefillService: compute a prompt, sample its first token, publish its KV blocks.

The engine request is the caller's with ``max_tokens = 1``: the scheduler
batches it with other prompts (chunked, prefix cached); when it finishes, the
KV connector publishes its blocks (full + partial last, only those the
store lacks) from a background thread and frees them once published; this
handler answers when the publish finished. The prefill engine keeps nothing
for the request beyond its prefix cache.
"""

from __future__ import annotations

import dataclasses

import grpc

from tandem.contracts.block_hash import prompt_block_hashes
from tandem.contracts.proto import finish_reason_to_proto, logprobs_to_proto
from tandem.engine.stop import check_stop
from tandem.services.common.context import ServiceContext, now_ns
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
            # An aborted request publishes nothing: don't wait for it.
            result = await saved if saved is not None and not aborted else None
        finally:
            if ctx.transfers is not None:
                ctx.transfers.forget(req.request_id)
        done_ns = now_ns()
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
            block_hashes=prompt_block_hashes(req.prompt_token_ids, ctx.block_size),
            kv_layout_fingerprint=ctx.kv_layout_fingerprint,
            hash_algorithm=ctx.hash_algorithm,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            queue_ns=max(scheduled_ns - arrival_ns, 0),
            compute_ns=max(token_ns - scheduled_ns, 0),
            publish_ns=max(done_ns - token_ns, 0) if result is not None else 0,
        )
        if first.new_logprobs and full_params.logprobs is not None:
            resp.first_logprobs.CopyFrom(
                logprobs_to_proto(token_id, first.new_logprobs[0], full_params.logprobs)
            )
        if stop is not None and stop.stop_reason is not None:
            resp.stop_token_id = stop.stop_reason
        m = ctx.metrics
        m.labels(m.time_to_first_token).observe((token_ns - arrival_ns) / 1e9)
        if result is not None:
            m.labels(m.kv_publish_seconds).observe((done_ns - token_ns) / 1e9)
        return resp

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return await self._ctx.load_response()


def _mono_ns(monotonic_s: float | None, default_ns: int) -> int:
    """A ``time.monotonic()`` seconds stamp in ns (``default_ns`` when unset)."""
    return default_ns if monotonic_s is None else int(monotonic_s * 1e9)
