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
from typing import Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.contracts.role import ROLES, Role
from tandem.engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.engine.cpu_turns import CpuTurns
from tandem.kvstore.config import ClientOptions, StoreConnectorConfig
from tandem.services.common.context import ServiceContext
from tandem.services.common.engine_loop import EngineLoop
from tandem.services.common.errors import ErrorMappingInterceptor
from tandem.services.common.periodic import start_periodic, stop_periodic
from tandem.services.common.registry import InstanceRegistration
from tandem.services.common.tls import TLSFiles, add_tls_flags, tls_from_args

logger = logging.getLogger(__name__)

_KV_ROLE: dict[Role, Literal["kv_producer", "kv_consumer"]] = {
    Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}
# 64 MiB: a 32k-token prompt's ids plus its block hashes fit with room to spare.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_bool_flag(text: str) -> bool:
    """``true|false`` (also ``1|0``, ``yes|no``, ``on|off``) of a boolean flag.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser(prog: str, role: Role | None) -> argparse.ArgumentParser:
    """The binding flags of ``tandem prefill|decode|serve`` (``role=None`` adds ``--role``)."""
    p = argparse.ArgumentParser(prog=prog, description=f"tandem {role or 'engine'} gRPC service")
    if role is None:
        p.add_argument("--role", choices=[r.value for r in ROLES], required=True,
                       help="prefill | decode | both (colocated, no KV store)")
    p.add_argument("--listen", default="127.0.0.1:50061", help="gRPC HOST:PORT to bind")
    p.add_argument("--model", default=None,
                   help="HF model folder or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--redis-url", default=None,
                   help="Redis URL for the instance registry and the KV store index "
                        "(required for prefill and decode)")
    p.add_argument("--advertise-address", default=None,
                   help="HOST:PORT the router dials (default: --listen, wildcard host -> hostname)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache element type (vLLM's flag): auto = the model's dtype; fp8 "
                        "(= fp8_e4m3) or fp8_e5m2 hold about twice the tokens and move half "
                        "the bytes through the KV store")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                   help="quantized weights (vLLM's flag): default the checkpoint's own "
                        "quantization_config; int8 / int4 quantize an unquantized one on load")
    p.add_argument("--model-impl", default="auto", choices=("auto", "tandem", "transformers"),
                   help="which implementation runs the model (vLLM's flag): tandem's native "
                        "one, transformers' modeling code over tandem's paged attention, or "
                        "auto (native where the architecture has one, else transformers)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None, help="context length in tokens")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    p.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                   help="waiting-queue order (vLLM's flag): fcfs, or priority (lower request "
                        "`priority` first, then arrival; a full batch preempts its "
                        "lowest-priority request for a more urgent one); under fcfs a "
                        "non-zero priority is rejected")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="most prompt tokens one request takes per step (0: no cap)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV cache budget in bytes (default: profiled)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="force this many KV blocks (tests)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=DEFAULT_GPU_MEMORY_UTILIZATION, metavar="FRACTION",
                   help="CUDA: the fraction of the GPU's total memory this engine may take "
                        "(weights, activations and KV cache; vLLM's flag); engines sharing "
                        "a GPU must split it (`tandem up` does) (default 0.9)")
    p.add_argument("--kvstore", default=None,
                   help="HOST:PORT of a KV store node (default: nodes found in Redis)")
    p.add_argument("--kv-load-from-store", type=parse_bool_flag, default=True, metavar="BOOL",
                   help="load a prompt's blocks beyond the local prefix-cache hit from the KV "
                        "store when the store index holds them (default true)")
    p.add_argument("--kv-publish-output", type=parse_bool_flag, default=True, metavar="BOOL",
                   help="decode: publish the blocks of prompt + output of finished requests to "
                        "the KV store, for the conversation's next turn (default true)")
    p.add_argument("--kv-load-wait-s", type=float, default=5.0, metavar="S",
                   help="how long a load waits for blocks still being published before "
                        "it recomputes them: a decode's load of blocks the prefill is "
                        "still publishing (it answers before its publish ends), and any "
                        "engine's store lookup of a chat's next turn whose previous answer "
                        "a decode is still publishing (the router's kv_publish_in_flight "
                        "hint) (default 5; 0: recompute at once)")
    p.add_argument("--kvstore-timeout-s", type=float, default=10.0, metavar="S",
                   help="deadline of one KV store node request (put or get); a node that "
                        "stops answering costs this long before the blocks count as a miss "
                        "(default 10)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="queued requests beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--shutdown-grace-s", type=float, default=20.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--instance-id", default=None, help="registry id (default: random)")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's global generator")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram"|"draft_model", '
                        '"num_speculative_tokens": k, "prompt_lookup_min": .., '
                        '"prompt_lookup_max": .., "model": PATH} (default: off)')
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a greedy request gives the same tokens "
                        "whatever it is batched with, cached or chunked (vLLM's "
                        "VLLM_BATCH_INVARIANT; CPU only, costs prefill throughput)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: never replay CUDA graphs, run every step eagerly (vLLM's flag)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="CUDA: decode batch sizes to capture as CUDA graphs (default: "
                        "1, 2, 4, 8, 16, 24, ... up to --max-cudagraph-capture-size)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="CUDA: largest default capture size (default: min(2 x "
                        "--max-num-seqs, 512))")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="worker processes that split each layer (heads, MLP columns, "
                        "vocabulary) and all-reduce (gloo on CPU, NCCL on CUDA)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="worker processes that split the layer stack into stages")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: each tensor-parallel rank holds num_experts / "
                        "--tensor-parallel-size experts whole (vLLM's flag)")
    p.add_argument("--distributed-executor-backend", choices=["uni", "mp"], default=None,
                   help="'uni': one in-process worker; 'mp': one process per rank "
                        "(default: 'mp' when tensor x pipeline parallel size > 1)")
    p.add_argument("--shared-cpu-lock", default=None, metavar="PATH",
                   help="a lock file that every engine sharing this host's CPU cores names: "
                        "their model steps take turns instead of running two OpenMP teams "
                        "on the same cores (`tandem up` sets it for unpinned engines on "
                        "the CPU; default: off)")
    p.add_argument("--log-level", default="INFO")
    add_tls_flags(p, "this service's gRPC port")
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
        store = StoreConnectorConfig(redis_url=ns.redis_url, kvstore_address=ns.kvstore or None,
                                     client_options=ClientOptions.from_environ(os.environ),
                                     load_from_store=ns.kv_load_from_store,
                                     publish_output=ns.kv_publish_output,
                                     kv_load_wait_s=ns.kv_load_wait_s,
                                     kvstore_timeout_s=ns.kvstore_timeout_s)
        kv = KVTransferConfig(kv_connector="store", kv_role=_KV_ROLE[role], connector_config=store)
    if ns.shared_cpu_lock:
        try:  # here, not after the model has loaded
            CpuTurns(ns.shared_cpu_lock).close()
        except OSError as e:
            raise ValueError(f"--shared-cpu-lock {ns.shared_cpu_lock}: cannot open or create "
                             f"it ({e.strerror})") from e
    return EngineConfig(
        model=ModelConfig(model=ns.model, dtype=ns.dtype, device=ns.device,
                          max_model_len=ns.max_model_len, seed=ns.seed,
                          deterministic=ns.deterministic, enforce_eager=ns.enforce_eager,
                          model_impl=ns.model_impl, quantization=ns.quantization),
        cache=CacheConfig(block_size=ns.block_size, kv_cache_memory_bytes=ns.kv_cache_memory,
                          gpu_memory_utilization=ns.gpu_memory_utilization,
                          num_blocks_override=ns.num_kv_blocks,
                          cache_dtype=ns.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=ns.max_num_batched_tokens,
                                  max_num_seqs=ns.max_num_seqs,
                                  policy=ns.scheduling_policy,
                                  long_prefill_token_threshold=ns.long_prefill_token_threshold),
        parallel=ParallelConfig(tensor_parallel_size=ns.tensor_parallel_size,
                                pipeline_parallel_size=ns.pipeline_parallel_size,
                                enable_expert_parallel=ns.enable_expert_parallel,
                                distributed_executor_backend=ns.distributed_executor_backend,
                                shared_cpu_lock=ns.shared_cpu_lock),
        kv_transfer=kv,
        speculative=(
            None if ns.speculative_config is None
            else SpeculativeConfig.from_json(ns.speculative_config)
        ),
        compilation=CompilationConfig(
            cudagraph_capture_sizes=(None if ns.cuda_graph_sizes is None
                                     else tuple(ns.cuda_graph_sizes)),
            max_cudagraph_capture_size=ns.max_cudagraph_capture_size,
        ),
    )


def in_flag_words(message: str, ns: argparse.Namespace, parser: argparse.ArgumentParser
                  ) -> str:
    """``message`` of a config error with the config field it starts with (the engine's
    configs name their fields: ``max_num_seqs must be >= 1``) written as the flag the user
    typed (``--max-num-seqs must be >= 1``); other messages unchanged."""
    usage = parser.format_usage()
    for dest in sorted(vars(ns), key=len, reverse=True):
        flag = "--" + dest.replace("_", "-")
        if message.startswith((f"{dest} ", f"{dest}:")) and re.search(
                rf"{re.escape(flag)}(?![\w-])", usage):
            return flag + message[len(dest):]
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
    role = role or Role.parse(ns.role)
    logging.basicConfig(level=ns.log_level.upper(),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    try:
        config = build_engine_config(ns, role)
        tls = tls_from_args(ns)
        if tls.enabled:
            tls.server_credentials()  # a CA alone is no server identity: refuse it now
    except ValueError as exc:
        print(f"{prog}: error: {in_flag_words(str(exc), ns, parser)}", file=sys.stderr)
        return 2
    if role not in servicers:
        print(f"{prog}: error: role {role!r} is not served by this entry point", file=sys.stderr)
        return 2
    return asyncio.run(_serve(ns, role, config, servicers[role], tls))


async def _serve(
    ns: argparse.Namespace, role: Role, config: EngineConfig, add_servicers: AddServicers,
    tls: TLSFiles,
) -> int:
    """Serve until SIGTERM/SIGINT or the engine's death; the exit code (1: the engine
    died, e.g. a worker process was killed)."""
    # Imported here: `tandem serve --help` should not pay for torch.
    from tandem.engine.engine_core import EngineCore

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def has_pending_transfers_of(engine: EngineCore) -> Callable[[], bool] | None:
        connector = engine.connector_worker
        return connector.has_pending if connector else None

    try:
        # Built in the engine thread, which then steps it (see EngineLoop.launch).
        engine_loop = await EngineLoop.launch(lambda: EngineCore(config), loop,
                                              has_pending_transfers_of, on_engine_dead=stop.set)
    except ValueError as exc:
        # A setting the model or this machine cannot take (a tensor-parallel size that
        # does not divide the heads, more workers than CPUs...): a usage error.
        print(f"{ns.prog}: error: {exc}", file=sys.stderr)
        return 2
    engine = engine_loop.engine
    ctx = ServiceContext(role=role, engine_loop=engine_loop, config=config,
                         max_waiting=ns.max_waiting)
    ctx.attach_connector_events(loop)

    server = grpc.aio.server(
        interceptors=[ErrorMappingInterceptor()],
        options=[("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)],
    )
    names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
    names.extend(add_servicers(ctx, server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(names, server)
    port = (server.add_secure_port(ns.listen, tls.server_credentials()) if tls.enabled
            else server.add_insecure_port(ns.listen))
    if port == 0:
        raise RuntimeError(f"could not bind --listen {ns.listen}")
    await server.start()
    address = advertise_address(ns.listen, ns.advertise_address, port)

    metrics_server = gauges_task = None
    if ns.metrics_port is not None:
        metrics_server = ctx.metrics.serve(ns.metrics_port)

        async def refresh_gauges() -> None:
            # registry_load also sets the Prometheus gauges (queues, KV usage), with or
            # without Redis
            await ctx.registry_load()

        gauges_task = await start_periodic(refresh_gauges, 1.0, what="refreshing metrics gauges",
                                           log=logger)

    registration = None
    if ns.redis_url:
        registration = InstanceRegistration(
            ns.redis_url, role, ns.instance_id or uuid.uuid4().hex[:12], address,
            ctx.model_id, ctx.registry_load)
        await registration.start()
    for name in ["", *names[2:]]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info("serving %s on %s (advertised %s), model %s", role, ns.listen, address,
                ctx.model_id)

    await stop.wait()
    logger.info("shutting down: draining for up to %.1f s", ns.shutdown_grace_s)
    await health_servicer.enter_graceful_shutdown()
    if registration is not None:
        await registration.stop()
    engine_loop.stop_accepting()
    await server.stop(ns.shutdown_grace_s)
    await stop_periodic(gauges_task)  # its ticks ask the engine loop for stats
    await engine_loop.shutdown()
    ctx.close()
    await asyncio.to_thread(engine.executor.shutdown)  # worker processes exit
    if metrics_server is not None:
        metrics_server.shutdown()
    if engine_loop.dead is not None:
        logger.error("stopped: the engine died (%s)", engine_loop.dead)
        return 1
    logger.info("stopped")
    return 0
