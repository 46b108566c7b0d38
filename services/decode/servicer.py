"""DecodeService: continue a prefilled request from its KV blocks, or run it whole.

Disaggregated form (``first_token_id`` set): the request enters the engine with
the prompt and the first token as output token 1; with ``block_hashes`` the
store KV connector loads the prompt's blocks (the request waits in
WAITING_FOR_REMOTE_KV, other requests keep decoding), recomputing whatever it
could not load; with ``kv_publish_pending`` (the prefill answered before its
publish ended) it first waits for blocks not in the store yet, up to
``--kv-load-wait-s``; then each step streams the new tokens. A seeded request samples
what the prefill side would have: its draws are keyed by output position
(``Request.step_generator``).

Colocated form (no ``first_token_id``): the engine computes the prompt and
streams every token from the first. With ``output_token_ids`` (the router
migrating a request whose instance failed) those tokens are output already:
the engine computes prompt + them and streams the tokens after them.

Requests arrive as streams of ``DecodeStream``, many over one call (see
:mod:`services.decode.stream`), each through the per-request logic here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.block_key import KVTransferParams
from tandem.contracts.proto import (
    finish_reason_to_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
    publish_in_flight_from_proto,
)
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.engine.stop import check_stop
from tandem.engine.validation import check_context_length, check_token_ids
from tandem.services.common.context import ServiceContext, cdiv, now_ns
from tandem.services.common.engine_spans import (
    EngineStreamTimes,
    end_span,
    record_pull,
    record_schedule,
    request_span,
)
from tandem.services.decode.stream import serve_decode_stream
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Thin servicer: protobuf -> engine -> protobuf. Errors map in ``common.errors``."""

    def __init__(self, ctx: ServiceContext) -> None:
        self._ctx = ctx
        self._foreign_seen: set[str] = set()  # foreign layouts already logged

    def _build(self, request: decode_pb2.DecodeRequest) -> Request:
        """Validate the request and build the engine ``Request`` (first token appended).

        Raises:
            ValueError: a bad field (named). Blocks of another KV layout are a miss:
                the prompt is recomputed here (``_foreign_blocks``).
        """
        ctx = self._ctx
        req = ctx.new_request(
            request.request_id, request.prompt_token_ids, request.sampling_params, request.priority
        )
        req.cache_salt = request.cache_salt or None
        if request.HasField("first_token_id") or request.output_token_ids:
            # The prompt's logprobs came from the instance that computed it; asking
            # again would only turn off this instance's KV load (a full recompute).
            req.sampling_params = dataclasses.replace(req.sampling_params, prompt_logprobs=None)
        if request.HasField("kv_publish_in_flight"):
            if request.HasField("first_token_id") and not request.output_token_ids:
                raise ValueError("kv_publish_in_flight is for the colocated form (this "
                                 "instance's own store lookup); send no first_token_id")
            req.kv_publish_in_flight = publish_in_flight_from_proto(request.kv_publish_in_flight)
        if request.output_token_ids:
            self._resume(req, list(request.output_token_ids), request)
            return req
        if not request.HasField("first_token_id"):
            if request.block_hashes:
                raise ValueError("block_hashes requires first_token_id (the disaggregated form)")
            return req
        check_token_ids([request.first_token_id], ctx.vocab_size, "first_token_id")
        req.append_output_token(request.first_token_id)
        if request.block_hashes:
            if not ctx.has_store:
                raise ValueError(
                    "block_hashes: this colocated instance has no KV store; send no block_hashes"
                )
            foreign = self._foreign_blocks(request)
            if foreign:
                # Blocks of another layout (an FP8 prefill for an auto decode, another
                # block size...) are never read as this engine's: the prompt is a miss
                # here, computed from its tokens (the engine's own store lookup, under
                # its own fingerprint, is counted as a store-tier query without a hit).
                if foreign not in self._foreign_seen:
                    self._foreign_seen.add(foreign)
                    logger.warning("decode: a prefill sent blocks of another KV layout (%s); "
                                   "those prompts are recomputed here", foreign)
                return req
            # Checks each hash's length (ValueError naming block_hashes[i]).
            hashes = tuple(BlockHash(h) for h in request.block_hashes)
            remote = KVTransferParams(hashes, request.kv_layout_fingerprint,
                                      publish_pending=request.kv_publish_pending)
            expected = cdiv(req.num_prompt_tokens, ctx.block_size)
            if len(remote.block_hashes) != expected:
                raise ValueError(
                    f"block_hashes has {len(remote.block_hashes)} entries; a prompt of "
                    f"{req.num_prompt_tokens} tokens in blocks of {ctx.block_size} has {expected}"
                )
            req.kv_transfer_params = remote
        return req

    def _foreign_blocks(self, request: decode_pb2.DecodeRequest) -> str:
        """What makes a handoff's blocks another layout's than this engine's (its
        ``kv_layout_fingerprint`` or ``hash_algorithm``), or "" when they are its own."""
        ctx = self._ctx
        if request.kv_layout_fingerprint != ctx.kv_layout_fingerprint:
            return (f"kv_layout_fingerprint {request.kv_layout_fingerprint.hex()[:16]}, "
                    f"this engine's {ctx.kv_layout_fingerprint.hex()[:16]}")
        if request.hash_algorithm != ctx.hash_algorithm:
            return (f"hash_algorithm {request.hash_algorithm!r}, this engine's "
                    f"{ctx.hash_algorithm!r}")
        return ""

    def _resume(self, req: Request, output: list[int], request: decode_pb2.DecodeRequest
                ) -> None:
        """Append the output tokens another instance delivered before it failed.

        Raises:
            ValueError: naming ``output_token_ids``: sent with the disaggregated form,
                ids outside the vocabulary, no room left in ``max_tokens`` or the context.
        """
        if request.HasField("first_token_id") or request.block_hashes:
            raise ValueError(
                "output_token_ids: resuming is the colocated form; send no first_token_id "
                "or block_hashes with it"
            )
        ctx = self._ctx
        check_token_ids(output, ctx.vocab_size, "output_token_ids")
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and len(output) >= max_tokens:
            raise ValueError(
                f"output_token_ids: {len(output)} tokens leave nothing to generate under "
                f"max_tokens {max_tokens}"
            )
        check_context_length(
            req.num_prompt_tokens + len(output), ctx.limits.max_model_len,
            field="output_token_ids",
        )
        for token in output:
            req.append_output_token(token)

    async def DecodeStream(
        self, request_iterator: AsyncIterator[decode_pb2.DecodeStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[decode_pb2.DecodeStreamResponse]:
        async for resp in serve_decode_stream(request_iterator, self._responses,
                                              self._ctx.engine_loop.draining):
            yield resp

    async def _responses(
        self, request: decode_pb2.DecodeRequest
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """The messages of one request's stream (see the module doc); raises what the
        request fails with (``services.common.errors`` maps it to the stream's error)."""
        ctx = self._ctx
        arrival_ns = now_ns()
        req = self._build(request)
        span = request_span(ctx.tracing, "tandem.decode", request.trace_context, req, arrival_ns)
        # A grammar this instance cannot compile, or one that rejects the first token
        # (checked by the engine when it replays it), fails the request: never
        # unconstrained output.
        await ctx.check_structured_outputs(req)
        if req.output_token_ids:
            # the last token given (first_token_id, or the last of output_token_ids) may
            # already finish the request: then nothing is left to generate
            stop = check_stop(req, ctx.max_seq_len)
            if stop is not None:
                yield decode_pb2.DecodeResponse(
                    finish_reason=finish_reason_to_proto(stop.finish_reason), num_cached_tokens=0
                )
                return
        num_top = req.sampling_params.logprobs
        num_prompt_top = req.sampling_params.prompt_logprobs
        first = True
        num_tokens = 0
        finish_reason = None
        times = EngineStreamTimes() if span is not None else None
        try:
            async with await ctx.engine_loop.add_request(req) as stream:
                # Outputs that are ready together go out as one message: a stream that
                # fell behind the engine catches up in one write, not one per step.
                async for batch in stream.batches():
                    resp = decode_pb2.DecodeResponse()
                    for out, _ in batch:
                        resp.token_ids.extend(out.new_token_ids)
                        if out.prompt_logprobs is not None and num_prompt_top is not None:
                            resp.prompt_logprobs.extend(prompt_logprobs_to_proto(
                                req.prompt_token_ids, out.prompt_logprobs, num_prompt_top))
                        if out.new_logprobs and num_top is not None:
                            for tok, pos in zip(out.new_token_ids, out.new_logprobs,
                                                strict=True):
                                resp.logprobs.append(logprobs_to_proto(tok, pos, num_top))
                    last = batch[-1][0]
                    if last.finish_reason is not None:
                        resp.finish_reason = finish_reason_to_proto(last.finish_reason)
                    if isinstance(last.stop_reason, int):
                        resp.stop_token_id = last.stop_reason
                    if first:
                        first = False
                        self._first_message_fields(req, resp, batch[0][0], arrival_ns, span)
                        record_schedule(ctx.tracing, span, req, arrival_ns, batch[0][1],
                                        "tandem.decode_queue", "tandem.first_decode_step")
                    if times is not None:
                        times.add(batch, now_ns())
                    num_tokens += len(resp.token_ids)
                    if last.finish_reason is not None:
                        finish_reason = last.finish_reason
                        ctx.metrics.labels(
                            ctx.metrics.request_success, finished_reason=last.finish_reason
                        ).inc()
                    yield resp
        finally:
            if ctx.transfers is not None:
                ctx.transfers.forget(req.request_id)
            end_span(span, finish_reason, num_tokens, times)

    def _first_message_fields(
        self,
        req: Request,
        resp: decode_pb2.DecodeResponse,
        out: EngineCoreOutput,
        arrival_ns: int,
        span: trace.Span | None,
    ) -> None:
        """Fill the first message's one-off fields (cached tokens, queue, KV pull time);
        the KV pull's span when tracing."""
        ctx = self._ctx
        m = ctx.metrics
        resp.num_cached_tokens = max(out.num_cached_tokens, 0)
        if req.first_scheduled_time is not None:
            resp.queue_ns = max(int(req.first_scheduled_time * 1e9) - arrival_ns, 0)
        load = ctx.transfers.pop_load(req.request_id) if ctx.transfers is not None else None
        if load is not None:
            resp.kv_pull_ns = max(load.done_ns - arrival_ns, 0)
            resp.kv_pull_bytes = load.num_bytes
            m.labels(m.kv_pull_seconds).observe(resp.kv_pull_ns / 1e9)
            record_pull(ctx.tracing, span, arrival_ns, load)
            if load.wait_outcome is not None:
                m.labels(m.kv_load_waits, outcome=load.wait_outcome).inc()
                m.labels(m.kv_load_wait_seconds).observe(load.wait_ns / 1e9)
        m.labels(m.time_to_first_token).observe((now_ns() - arrival_ns) / 1e9)

    async def GetLoad(
        self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.GetLoadResponse:
        return await self._ctx.load_response()

