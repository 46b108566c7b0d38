"""gRPC clients of the engine instances (PrefillService, DecodeService), one channel each.

:class:`InstancePool` keeps one ``grpc.aio`` channel per address for the router's life
(HTTP/2 multiplexes every concurrent request over it) and closes them on shutdown; decode
requests to an instance share one ``DecodeStream`` call on it (``decode_mux``).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from tandem.contracts.role import Role
from tandem.services.common.periodic import start_periodic, stop_periodic
from tandem.services.router.decode_mux import DecodeMux, MuxedDecode
from tandem.services.router.discovery import Discovery
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# Large prompts' token lists and logprobs fit easily; keep the limit explicit.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # An instance restarted on its address (tandem up's supervisor reuses the port) must
    # be reachable as soon as it listens: with gRPC's default reconnect backoff (up to
    # 120 s) the channel stays in TRANSIENT_FAILURE long after, failing every call fast.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]

#: gRPC codes that mean "the request itself is bad": reported to the client, not retried.
CALLER_ERROR_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.OUT_OF_RANGE})


class InstancePool:
    """Channels and stubs per instance address; reused by every request.

    Args:
        discovery: where GetLoad results are written by :meth:`poll_loads`.
        credentials: TLS for every channel (``tls.TLSFiles.channel_credentials``), or
            ``None`` for plaintext.
        options: extra channel options (``tls.TLSFiles.channel_options``).
    """

    def __init__(self, discovery: Discovery,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: list[tuple[str, str]] | None = None) -> None:
        self._discovery = discovery
        self._muxes: dict[str, DecodeMux] = {}
        self._credentials = credentials
        self._options = [*_CHANNEL_OPTIONS, *(options or [])]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._task: asyncio.Task | None = None

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = (grpc.aio.secure_channel(address, self._credentials, options=self._options)
                  if self._credentials is not None
                  else grpc.aio.insecure_channel(address, options=self._options))
            self._channels[address] = ch
        return ch

    def prefill_stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        return prefill_pb2_grpc.PrefillServiceStub(self.channel(address))

    def decode_stub(self, address: str) -> decode_pb2_grpc.DecodeServiceStub:
        return decode_pb2_grpc.DecodeServiceStub(self.channel(address))

    async def prefill(self, address: str, req: prefill_pb2.PrefillRequest,
                      metadata: tuple[tuple[str, str], ...] = ()) -> prefill_pb2.PrefillResponse:
        """One Prefill call. Cancelling the awaiting task cancels the RPC.

        Raises:
            grpc.aio.AioRpcError: the call failed (code tells why).
        """
        return await self.prefill_stub(address).Prefill(req, metadata=metadata)

    def decode(self, address: str, req: decode_pb2.DecodeRequest) -> MuxedDecode:
        """Start a decode stream on the instance's one ``DecodeStream`` call
        (:mod:`services.router.decode_mux`); iterate it, and ``cancel()`` it to abort the
        request.
        """
        mux = self._muxes.get(address)
        if mux is None:
            mux = self._muxes[address] = DecodeMux(address, self.decode_stub(address),
                                                   self._mux_closed)
        return mux.start(req)

    def _mux_closed(self, mux: DecodeMux, error: grpc.aio.AioRpcError) -> None:
        if self._muxes.get(mux.address) is mux:
            del self._muxes[mux.address]

    async def get_load(self, address: str, role: Role, timeout_s: float = 2.0
                       ) -> common_pb2.GetLoadResponse:
        stub = self.prefill_stub(address) if role == Role.PREFILL else self.decode_stub(address)
        return await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)

    async def poll_loads(self) -> None:
        """GetLoad from every known instance; copies the results into discovery's view
        and recomputes what the instances serve (``Discovery.reconcile``)."""
        infos = self._discovery.all_instances()
        results = await asyncio.gather(
            *(self.get_load(i.address, i.role) for i in infos), return_exceptions=True
        )
        for info, res in zip(infos, results, strict=True):
            info.alive = not isinstance(res, BaseException)
            if isinstance(res, BaseException):
                continue
            info.running = res.num_running_requests
            info.waiting = res.num_waiting_requests
            info.kv_usage = res.kv_cache_usage
            info.num_free_blocks = res.num_free_blocks
            info.prefix_cache_hit_rate = res.prefix_cache_hit_rate
            info.block_size = res.block_size or info.block_size
            info.kv_layout_fingerprint = res.kv_layout_fingerprint or info.kv_layout_fingerprint
            info.kv_publish_output = res.kv_publish_output
            info.model = res.model or info.model
            # NOTE: 0 / "" is an engine older than these fields: keep what the registry said
            info.max_model_len = res.max_model_len_tokens or info.max_model_len
            info.vocab_size = res.vocab_size_tokens or info.vocab_size
            info.architecture = res.architecture or info.architecture
            info.model_impl = res.model_impl or info.model_impl
        self._discovery.reconcile()

    async def start(self, interval_s: float = 1.0) -> None:
        """Poll loads now and then every ``interval_s`` in the background (load reports
        are advisory: a failed poll is logged at DEBUG, retried next tick)."""
        self._task = await start_periodic(self.poll_loads, interval_s, what="load poll",
                                          log=logger, level=logging.DEBUG)

    async def close(self) -> None:
        await stop_periodic(self._task)
        self._task = None
        muxes, self._muxes = self._muxes, {}
        await asyncio.gather(*(m.close() for m in muxes.values()), return_exceptions=True)
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(ch.close() for ch in channels.values()), return_exceptions=True)
