"""The public gRPC API: ``tandem.v1.GenerationService.Generate`` (server streaming).

Same pipeline as the HTTP routes; text in, text deltas and token ids out. Errors map from
``OpenAIError`` status to gRPC codes: 400 -> INVALID_ARGUMENT, 401 -> UNAUTHENTICATED,
404 -> NOT_FOUND, 429 (a tenant's limit, ``tenancy``) and 503 overloaded ->
RESOURCE_EXHAUSTED, 503 no instance -> UNAVAILABLE. The API key is the ``authorization:
Bearer KEY`` (or ``x-api-key``) metadata; with ``--api-keys`` its tenant's limits apply as
on the HTTP doors.
A cancelled client stream cancels the pipeline (and so every engine RPC).

The port also serves ``grpc.health.v1`` (overall and per service) and server reflection,
as the engine services do (``services/common/server.py``), so grpcurl-style clients can
list and call ``tandem.v1.GenerationService`` without the .proto files.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from tandem.contracts.proto import finish_reason_to_proto, sampling_params_from_proto
from tandem.engine.validation import RequestError, check_context_length
from tandem.services.router.errors import OpenAIError, from_request_error
from tandem.services.router.frontend import Frontend
from tandem.services.router.protocol import default_max_tokens
from tandem.services.router.sequence import GenerationRequest, SeqDelta
from tandem.services.router.tenancy import Tenancy
from tandem.services.router.tenants import Tenant, key_of
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)


def _grpc_code(err: OpenAIError) -> grpc.StatusCode:
    if err.status_code == 503:
        return (grpc.StatusCode.RESOURCE_EXHAUSTED if "overloaded" in err.message
                else grpc.StatusCode.UNAVAILABLE)
    return {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
            404: grpc.StatusCode.NOT_FOUND,
            429: grpc.StatusCode.RESOURCE_EXHAUSTED}.get(err.status_code, grpc.StatusCode.INTERNAL)


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Thin servicer: protobuf -> pipeline -> protobuf. ``tenancy``: the ``--api-keys``
    tenants, or ``None`` (``fe.api_key`` alone)."""

    def __init__(self, fe: Frontend, tenancy: Tenancy | None = None) -> None:
        self.fe = fe
        self.tenancy = tenancy

    async def generate_from_bytes(self, raw: bytes, context: grpc.aio.ServicerContext
                                  ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """``Generate`` on the serialized request, so that bytes protobuf refuses (a
        string field that is not UTF-8) are INVALID_ARGUMENT, not grpc's UNKNOWN for a
        failed deserializer (which also logs a traceback)."""
        try:
            request = generation_pb2.GenerateRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"not a valid tandem.v1.GenerateRequest: {exc}")
        async for out in self.Generate(request, context):
            yield out

    async def Generate(self, request: generation_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            tenant = self._authenticate(context)
            gen = self._to_generation_request(request, context)
            gen.trace_parent = self.fe.pipeline.tracing.extract(
                context.invocation_metadata() or ())
            num_tokens = 0
            num_cached = None
            deltas: AsyncGenerator[SeqDelta, None] = self.fe.pipeline.generate(gen)
            if tenant is not None:
                assert self.tenancy is not None, "a tenant comes from the tenancy"
                deltas = _unindexed(self.tenancy.generate(tenant, _indexed(deltas), [gen]))
            async for d in deltas:
                num_tokens += len(d.token_ids)
                if num_cached is None:
                    # the first delta carries it (all completions share the prompt)
                    num_cached = d.num_cached_tokens
                out = generation_pb2.GenerateResponse(
                    request_id=gen.request_id, text=d.text, token_ids=d.token_ids,
                    logprobs=d.logprobs or [])
                if d.finish_reason is not None:
                    out.finish_reason = finish_reason_to_proto(d.finish_reason)
                    if d.stop_reason is not None:
                        out.stop_reason = str(d.stop_reason)
                    out.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=len(gen.prompt_token_ids), completion_tokens=num_tokens,
                        cached_tokens=num_cached or 0))
                    if d.timings is not None:
                        t = d.timings
                        out.timings.CopyFrom(common_pb2.RequestTimings(
                            ttft_ns=t.ttft_ns, prefill_queue_ns=t.prefill_queue_ns,
                            prefill_compute_ns=t.prefill_compute_ns,
                            kv_publish_ns=t.kv_publish_ns, kv_pull_ns=t.kv_pull_ns,
                            e2e_ns=t.e2e_ns, decode_tokens=t.decode_tokens))
                yield out
        except OpenAIError as err:
            await context.abort(_grpc_code(err), err.message)

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """The caller's tenant with ``--api-keys``, else ``None``.

        Raises:
            OpenAIError: 401 for a missing or unknown key.
        """
        if self.tenancy is None:
            return None
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())
              if isinstance(v, str)}
        return self.tenancy.authenticate(key_of(md))

    def _to_generation_request(self, request: generation_pb2.GenerateRequest,
                               context: grpc.aio.ServicerContext) -> GenerationRequest:
        fe = self.fe
        if fe.api_key is not None:
            md = dict(context.invocation_metadata() or ())
            if md.get("authorization") != f"Bearer {fe.api_key}":
                raise OpenAIError("invalid or missing API key", status_code=401)
        fe.check_model(request.model or None)
        rid = fe.new_request_id(request.request_id)
        which = request.WhichOneof("prompt")
        if which == "text":
            ids = fe.tokenize_prompts(request.text)[0] if request.text else []
            fe.check_token_ids(ids, "text")
        elif which == "token_ids":
            ids = list(request.token_ids.ids)
            fe.check_token_ids(ids, "token_ids")
        elif which == "chat":
            if not request.chat.messages:
                raise OpenAIError("chat.messages must not be empty", param="chat")
            ids = fe.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in request.chat.messages])
        else:
            raise OpenAIError("one of text, token_ids or chat is required", param="prompt")
        msg = request.sampling_params
        max_tokens = msg.max_tokens if msg.HasField("max_tokens") else None
        defaults = fe.sampling_defaults
        try:
            max_model_len = fe.max_model_len
            room = None
            # NOTE: unknown until an instance reports it: the engine checks it then
            if max_model_len is not None:
                check_context_length(len(ids), max_model_len, max_tokens, field=which)
                room = max_model_len - len(ids)
            sp = sampling_params_from_proto(
                msg, max_tokens_if_unset=default_max_tokens(defaults.max_tokens, room),
                stop=list(request.stop),
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=(request.skip_special_tokens
                                     if request.HasField("skip_special_tokens") else True),
                defaults=defaults)
        except RequestError as exc:
            raise from_request_error(exc) from exc
        fe.check_sampling_params(sp)
        return GenerationRequest(rid, ids, sp)


async def _indexed(deltas: AsyncGenerator[SeqDelta, None]
                   ) -> AsyncGenerator[tuple[int, SeqDelta], None]:
    async with contextlib.aclosing(deltas):
        async for d in deltas:
            yield d.index, d


async def _unindexed(items: AsyncGenerator[tuple[int, SeqDelta], None]
                     ) -> AsyncGenerator[SeqDelta, None]:
    async with contextlib.aclosing(items):
        async for _, d in items:
            yield d


async def start_grpc_server(fe: Frontend, port: int, host: str = "0.0.0.0", *,
                            max_message_bytes: int = 64 * 1024 * 1024,
                            tenancy: Tenancy | None = None) -> grpc.aio.Server:
    """Start the public gRPC server (health and reflection included) on ``host:port``.

    Args:
        max_message_bytes: largest request message accepted (``--max-request-body-bytes``);
            grpc answers a larger one with RESOURCE_EXHAUSTED.
        tenancy: the ``--api-keys`` tenants and their limits, or ``None``.

    Raises:
        RuntimeError: the port could not be bound.
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes)])
    generation = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
    servicer = GenerationServicer(fe, tenancy)
    # NOTE: registered by hand (grpc's public generic-handler API) rather than with the
    # generated add_..._to_server, to parse requests in the servicer (generate_from_bytes).
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(generation, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.generate_from_bytes,
            response_serializer=generation_pb2.GenerateResponse.SerializeToString)}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [generation, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise RuntimeError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    for name in ("", generation):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server
