"""Shared entry point of the engine services: flags, engine, gRPC server, lifecycle.

``tandem prefill``, ``tandem decode`` and ``tandem serve --role ...`` all end in
:func:`run`. It builds the frozen ``EngineConfig`` from the flags, loads the
engine, starts the engine thread (:mod:`.engine_loop`), serves the role's
servicer(s) plus ``grpc.health.v1`` and server reflection on ``--listen``,
registers the instance in Redis with a heartbeat (the port serves TLS, mutual with
``--tls-ca``, when ``--tls-cert``/``--tls-key`` are given: ``tls.py``), and on SIGTERM/SIGINT
drains:
health NOT_SERVING and registry entry deleted (the router stops sending),
new RPCs refused, in-flight ones given ``--shutdown-grace-s`` to finish, then
the rest aborted and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.contracts.config_args import add_config_flags, config_from_args
from tandem.contracts.role import ROLES, Role
from tandem.contracts.tracing import (
    TracingConfig,
    add_tracing_flags,
    engine_service_name,
    start_tracing,
)
from tandem.engine.config import EngineConfig, KVTransferConfig
from tandem.engine.cpu_turns import CpuTurns
from tandem.engine.engine_args import (
    ENGINE_CONFIGS,
    add_engine_flags,
    engine_config_from_args,
    flag_words,
)
from tandem.kvstore.config import ClientOptions, StoreConnectorConfig
from tandem.services.common.context import ServiceContext
from tandem.services.common.engine_loop import EngineLoop
from tandem.services.common.errors import ErrorMappingInterceptor
from tandem.services.common.kv_events import (
    add_kv_events_flag,
    start_snapshot_task,
    with_kv_events,
)
from tandem.services.common.periodic import start_periodic, stop_periodic
from tandem.services.common.registry import InstanceRegistration
from tandem.services.common.tls import TLSFiles, add_tls_flags, tls_from_args

if TYPE_CHECKING:
    from tandem.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

_KV_ROLE: dict[Role, Literal["kv_producer", "kv_consumer"]] = {
    Role.PREFILL: "kv_producer",
    Role.DECODE: "kv_consumer",
}
# 64 MiB: a 32k-token prompt's ids plus its block hashes fit with room to spare.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def listen_address(text: str) -> str:
    """``--listen``'s type: ``text`` if it is ``HOST:PORT`` with a port in 0..65535.

    Raises:
        argparse.ArgumentTypeError: otherwise (grpc would take a larger port modulo 65536
            and fail on a malformed address only after the model loaded).
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a port in 0..65535, got {text!r}"
        )
    return text


def build_parser(prog: str, role: Role | None) -> argparse.ArgumentParser:
    """The flags of ``tandem prefill|decode|serve`` (``role=None`` adds ``--role``): the
    service's own here, the engine's and the store connector's generated from their config
    dataclasses (``engine/engine_args.py``, ``contracts/config_args.py``)."""
    p = argparse.ArgumentParser(prog=prog, description=f"tandem {role or 'engine'} gRPC service")
    if role is None:
        p.add_argument(
            "--role",
            choices=[r.value for r in ROLES],
            required=True,
            help="prefill | decode | both (colocated, no KV store)",
        )
    p.add_argument(
        "--listen", default="127.0.0.1:50061", type=listen_address, help="gRPC HOST:PORT to bind"
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis URL for the instance registry and the KV store index "
        "(required for prefill and decode)",
    )
    p.add_argument(
        "--advertise-address",
        default=None,
        help="HOST:PORT the router dials (default: --listen, wildcard host -> hostname)",
    )
    add_engine_flags(p)
    add_config_flags(p, StoreConnectorConfig)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="queued requests beyond which new ones get RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=20.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    p.add_argument("--instance-id", default=None, help="registry id (default: random)")
    p.add_argument("--log-level", default="INFO")
    add_tls_flags(p, "this service's gRPC port")
    add_kv_events_flag(p)
    add_tracing_flags(p)
    return p


def build_engine_config(ns: argparse.Namespace, role: Role | str) -> EngineConfig:
    """The frozen engine config of a role from parsed flags.

    Raises:
        ValueError: an invalid flag value (naming it), prefill/decode without --redis-url,
            or a ``--shared-cpu-lock`` file that cannot be opened or created.
    """
    role = Role.parse(role)
    if role.uses_store and not ns.redis_url:
        raise ValueError(f"--redis-url is required for role '{role}' (KV store index)")
    kv = KVTransferConfig()
    if role.uses_store:
        # the store client's environment (TANDEM_KV_SHM, ...), read once here at the edge
        store = config_from_args(
            StoreConnectorConfig,
            ns,
            redis_url=ns.redis_url,
            client_options=ClientOptions.from_environ(os.environ),
        )
        kv = KVTransferConfig(kv_connector="store", kv_role=_KV_ROLE[role], connector_config=store)
    if ns.shared_cpu_lock:
        try:  # here, not after the model has loaded
            CpuTurns(ns.shared_cpu_lock).close()
        except OSError as e:
            raise ValueError(
                f"--shared-cpu-lock {ns.shared_cpu_lock}: cannot open or create it ({e.strerror})"
            ) from e
    return with_kv_events(engine_config_from_args(ns, kv), ns)


def in_flag_words(message: str, ns: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """``message`` of a config error with the config field it starts with (the engine's
    configs name their fields: ``max_num_seqs must be >= 1``) written as the flag the user
    typed (``--max-num-seqs must be >= 1``), also where the flag is spelt apart from the
    field (``num_blocks_override`` -> ``--num-kv-blocks``); other messages unchanged."""
    renamed = flag_words(message, (*ENGINE_CONFIGS, StoreConnectorConfig))
    if renamed != message:
        return renamed
    usage = parser.format_usage()
    for dest in sorted(vars(ns), key=len, reverse=True):
        flag = "--" + dest.replace("_", "-")
        if message.startswith((f"{dest} ", f"{dest}:")) and re.search(
            rf"{re.escape(flag)}(?![\w-])", usage
        ):
            return flag + message[len(dest) :]
    return message


def advertise_address(listen: str, advertise: str | None, bound_port: int) -> str:
    """The address the router should dial: ``advertise`` or ``listen`` with a real host/port."""
    if advertise:
        return advertise
    host, _, _ = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"{host}:{bound_port}"


#: Adds one role's servicer(s) to the gRPC server; returns the full names of the services
#: it added (for health and reflection). Each role's entry point passes its own, so this
#: shared part never imports a role's servicer.
AddServicers = Callable[[ServiceContext, grpc.aio.Server], list[str]]


def run(
    argv: list[str] | None, prog: str, role: Role | None, servicers: Mapping[Role, AddServicers]
) -> int:
    """Parse flags, serve until SIGTERM/SIGINT, return the exit code (2 on bad flags).

    Args:
        role: the role this entry point serves, or ``None`` to take ``--role``.
        servicers: role -> what adds its servicers; the chosen role must be in it.
    """
    parser = build_parser(prog, role)
    ns = parser.parse_args(argv)
    ns.prog = prog
    ns.instance_id = ns.instance_id or uuid.uuid4().hex[:12]  # also the KV events' topic
    role = role or Role.parse(ns.role)
    logging.basicConfig(
        level=ns.log_level.upper(), format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = build_engine_config(ns, role)
        tls = tls_from_args(ns)
        if tls.enabled:
            tls.server_credentials()  # a CA alone is no server identity: refuse it now
        tracing = TracingConfig.from_args(ns, os.environ, engine_service_name(role))
    except ValueError as exc:
        print(f"{prog}: error: {in_flag_words(str(exc), ns, parser)}", file=sys.stderr)
        return 2
    if role not in servicers:
        print(f"{prog}: error: role {role!r} is not served by this entry point", file=sys.stderr)
        return 2
    return asyncio.run(_serve(ns, role, config, servicers[role], tls, tracing))


def _stop_on_signals(loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the service then drains and stops)."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _pending_transfers_of(engine: EngineCore) -> Callable[[], bool] | None:
    """Whether ``engine``'s KV connector has transfers in flight (``None``: no connector)."""
    connector = engine.connector_worker
    return connector.has_pending if connector else None


async def _register(ns: argparse.Namespace, role: Role, address: str, ctx: ServiceContext,
                    config: EngineConfig) -> InstanceRegistration | None:
    """Register this instance in Redis for the routers (``--redis-url``; ``None``
    without it), heartbeats started."""
    if not ns.redis_url:
        return None
    registration = InstanceRegistration(
        ns.redis_url,
        role,
        ns.instance_id,
        address,
        ctx.model_id,
        ctx.registry_load,
        kv_events_topic=config.kv_events.topic
        if config.kv_events.enable_kv_cache_events
        else "",
    )
    await registration.start()
    return registration


def _grpc_server(
    listen: str, ctx: ServiceContext, add_servicers: AddServicers, tls: TLSFiles
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, list[str], int]:
    """The gRPC server, not started: the role's servicers (``add_servicers``), health and
    reflection, error mapping, bound to ``listen`` (TLS when ``tls`` is on).

    Returns:
        The server, its health servicer, the service names it serves (reflection and
        health first) and the bound port.

    Raises:
        RuntimeError: ``listen`` could not be bound.
    """
    server = grpc.aio.server(
        interceptors=[ErrorMappingInterceptor()],
        options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
        ],
    )
    names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
    names.extend(add_servicers(ctx, server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(names, server)
    port = (
        server.add_secure_port(listen, tls.server_credentials())
        if tls.enabled
        else server.add_insecure_port(listen)
    )
    if port == 0:
        raise RuntimeError(f"could not bind --listen {listen}")
    return server, health_servicer, names, port


async def _serve(
    ns: argparse.Namespace,
    role: Role,
    config: EngineConfig,
    add_servicers: AddServicers,
    tls: TLSFiles,
    tracing: TracingConfig,
) -> int:
    """Serve until SIGTERM/SIGINT or the engine's death; the exit code (1: the engine
    died, e.g. a worker process was killed)."""
    # Imported here: `tandem serve --help` should not pay for torch.
    from tandem.engine.engine_core import EngineCore

    loop = asyncio.get_running_loop()
    stop = _stop_on_signals(loop)

    try:
        # Built in the engine thread, which then steps it (see EngineLoop.launch).
        engine_loop = await EngineLoop.launch(
            lambda: EngineCore(config), loop, _pending_transfers_of, on_engine_dead=stop.set
        )
    except ValueError as exc:
        # A setting the model or this machine cannot take (a tensor-parallel size that
        # does not divide the heads, more workers than CPUs...): a usage error.
        print(f"{ns.prog}: error: {exc}", file=sys.stderr)
        return 2
    engine = engine_loop.engine
    ctx = ServiceContext(
        role=role, engine_loop=engine_loop, config=config, max_waiting=ns.max_waiting
    )
    ctx.attach_connector_events(loop)
    ctx.tracing = start_tracing(tracing)
    if ctx.tracing.enabled:
        ctx.metrics.registry.register(ctx.tracing)

    server, health_servicer, names, port = _grpc_server(ns.listen, ctx, add_servicers, tls)
    await server.start()
    address = advertise_address(ns.listen, ns.advertise_address, port)

    metrics_server = gauges_task = None
    if ns.metrics_port is not None:
        metrics_server = ctx.metrics.serve(ns.metrics_port)

        async def refresh_gauges() -> None:
            # registry_load also sets the Prometheus gauges (queues, KV usage), with or
            # without Redis
            await ctx.registry_load()

        gauges_task = await start_periodic(
            refresh_gauges, 1.0, what="refreshing metrics gauges", log=logger
        )

    snapshot_task = await start_snapshot_task(engine_loop)
    registration = await _register(ns, role, address, ctx, config)
    for name in ["", *names[2:]]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "serving %s on %s (advertised %s), model %s", role, ns.listen, address, ctx.model_id
    )

    await stop.wait()
    logger.info("shutting down: draining for up to %.1f s", ns.shutdown_grace_s)
    await health_servicer.enter_graceful_shutdown()
    if registration is not None:
        await registration.stop()
    engine_loop.stop_accepting()
    await server.stop(ns.shutdown_grace_s)
    await stop_periodic(gauges_task)  # its ticks ask the engine loop for stats
    await stop_periodic(snapshot_task)
    await engine_loop.shutdown()
    ctx.close()
    ctx.tracing.shutdown()  # exports what is queued
    await asyncio.to_thread(engine.executor.shutdown)  # worker processes exit
    if metrics_server is not None:
        metrics_server.shutdown()
    if engine_loop.dead is not None:
        logger.error("stopped: the engine died (%s)", engine_loop.dead)
        return 1
    logger.info("stopped")
    return 0
