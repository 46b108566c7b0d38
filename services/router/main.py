"""`tandem router`: the OpenAI-compatible HTTP gateway (+ public gRPC API) in one process.

Flags and the ``TANDEM_API_KEY`` environment variable are read here and nowhere else.
Instances come from the Redis registry (``--redis-url``) or static lists (``--prefill``,
``--decode``, ``--colocated``): one of the two, validated in ``RouterConfig`` before anything loads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from tandem.contracts.config_args import add_config_flags
from tandem.contracts.tracing import add_tracing_flags, start_tracing
from tandem.engine.sampling_params import SamplingDefaults
from tandem.services.common.tls import add_tls_flags
from tandem.services.router.config import RouterConfig

logger = logging.getLogger("tandem.router")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``tandem router``: ``RouterConfig``'s fields (generated,
    ``contracts/config_args.py``) and those read into other values here (the static
    instance lists, the API-key file, TLS files, tracing)."""
    p = argparse.ArgumentParser(prog="tandem router", description=__doc__.splitlines()[0])
    add_config_flags(p, RouterConfig)
    p.add_argument("--prefill", default="", help="static prefill instances ADDR,ADDR...")
    p.add_argument("--decode", default="", help="static decode instances ADDR,ADDR...")
    p.add_argument("--colocated", default="", help="static colocated (role both) instances")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="YAML/JSON file mapping each API key to {tenant: NAME, "
                        "requests_per_minute: N, tokens_per_minute: N} (limits optional); "
                        "over a limit: 429 + Retry-After. Not with --api-key")
    add_tls_flags(p, "the router's connections to the engines", client=True)
    add_tracing_flags(p)
    return p


class _Server:
    """uvicorn's server without its signal capture.

    NOTE: uvicorn re-raises a captured SIGTERM after shutdown, so the process would exit
    by the signal (-15) even after a clean stop; here the signal only asks it to exit and
    ``main`` returns 0 once gRPC, channels and discovery are closed.
    """

    def __init__(self, config: Any) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self._server = Server(config)

    def request_exit(self) -> None:
        self._server.should_exit = True

    async def serve(self) -> None:
        await self._server.serve()


def _served_names(cfg: RouterConfig, name: str) -> list[str]:
    """The model names requests may use: the served name first, then the model's base
    name without a quantization suffix, and its path."""
    served = [cfg.served_model_name or name]
    for alias in (name, name.split(".")[0], cfg.model):
        if alias and alias not in served:
            served.append(alias)
    return served


def _discovery(cfg: RouterConfig, name: str) -> Any:
    """The instance discovery: the Redis registry, or the static lists."""
    from tandem.services.router.discovery import RedisDiscovery, StaticDiscovery

    if cfg.redis_url:
        return RedisDiscovery(cfg.redis_url, model=name)
    return StaticDiscovery(prefill=list(cfg.prefill), decode=list(cfg.decode),
                           both=list(cfg.colocated))


def _cache_view(cfg: RouterConfig, discovery: Any, metrics: Any) -> tuple[Any, Any, Any]:
    """The kv_aware policy's view of where prompts' KV lies: ``(view, store index probe
    or None, KV-events reader or None)``; the last two are the router's to close."""
    from tandem.services.router.routing import CacheView

    store_index = None
    if cfg.kv_index_url:
        from tandem.kvstore.lookup import AsyncIndexProbe

        store_index = AsyncIndexProbe(cfg.kv_index_url)
    events = None
    if cfg.redis_url:
        from tandem.services.router.kv_events import KVEventsReader

        # the engines started with --kv-events name their topic in the registry
        events = KVEventsReader(cfg.redis_url, lambda: [
            i.kv_events_topic for i in discovery.all_instances() if i.kv_events_topic])
    lookup_seconds = metrics.labels(metrics.kv_store_lookup_seconds)
    view = CacheView(store_index, on_lookup=lookup_seconds.observe, events=events)
    return view, store_index, events


def _tenancy(cfg: RouterConfig, metrics: Any) -> Any:
    """Per-tenant API keys and rate limits (``--api-keys``), or None."""
    if cfg.api_keys is None:
        return None
    from tandem.services.router.rate_limit import (
        MemoryRateLimiter,
        RateLimiter,
        RedisRateLimiter,
    )
    from tandem.services.router.tenancy import Tenancy, TenantMetrics

    limiter: RateLimiter = (RedisRateLimiter.from_url(cfg.rate_limit_url)
                            if cfg.rate_limit_url else MemoryRateLimiter())
    logger.info("%d API keys of %d tenants; limits counted %s", len(cfg.api_keys.by_key),
                len(cfg.api_keys.tenants),
                "in Redis" if cfg.rate_limit_url else "by this router alone")
    return Tenancy(cfg.api_keys, limiter, TenantMetrics(metrics.registry))


def _frontend(cfg: RouterConfig, tokenizer: Any, served: list[str], discovery: Any,
              metrics: Any, view: Any, tracing: Any,
              defaults: SamplingDefaults | None) -> Any:
    """The request pipeline (routing, admission, disaggregation) behind its frontend
    (validation, templates, parsers)."""
    from tandem.services.router.client import InstancePool
    from tandem.services.router.frontend import Frontend, read_chat_template
    from tandem.services.router.pipeline import Pipeline
    from tandem.services.router.routing import make_router

    pool = InstancePool(discovery, cfg.tls.channel_credentials() if cfg.tls.enabled else None,
                        cfg.tls.channel_options())
    pipeline = Pipeline(tokenizer=tokenizer, discovery=discovery, pool=pool,
                        router=make_router(cfg.routing_policy, view), metrics=metrics,
                        max_running=cfg.max_running_requests,
                        max_waiting=cfg.max_queued_requests, max_attempts=cfg.max_attempts,
                        max_migrations=cfg.max_migrations,
                        cache_view=view,
                        disagg_min_uncached_tokens=cfg.disagg_min_uncached_tokens,
                        disagg_max_prefill_queue=cfg.disagg_max_prefill_queue,
                        disagg_prefill_fallback=cfg.disagg_prefill_fallback, tracing=tracing)
    return Frontend(tokenizer=tokenizer, pipeline=pipeline, served_model_names=served,
                    max_model_len=cfg.max_model_len, api_key=cfg.api_key,
                    chat_template=read_chat_template(cfg.chat_template) if cfg.chat_template
                    else None, tool_call_parser=cfg.tool_call_parser,
                    sampling_defaults=defaults or SamplingDefaults(),
                    reasoning_parser=cfg.reasoning_parser)


async def _serve_http(cfg: RouterConfig, app: Any, drain: Any) -> None:
    """Serve ``app`` until a signal: the first drains (up to ``--shutdown-grace-s``) then
    exits, a second exits at once."""
    import uvicorn

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port,
                            log_level=cfg.log_level.lower(), timeout_graceful_shutdown=3,
                            access_log=False, http=cfg.http)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []

    async def drain_then_exit() -> None:
        await drain.run(cfg.shutdown_grace_s)
        server.request_exit()

    def on_signal() -> None:
        if stopping:  # a second signal: stop now
            server.request_exit()
        else:
            stopping.append(asyncio.create_task(drain_then_exit()))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await server.serve()


async def serve(cfg: RouterConfig, defaults: SamplingDefaults | None = None) -> None:
    """Build everything, serve HTTP and gRPC until SIGINT/SIGTERM, then close cleanly.
    ``defaults``: requests' default sampling values (``--generation-config``)."""
    from tandem.engine.model_files import load_tokenizer, model_id_of
    from tandem.services.router.app import create_app
    from tandem.services.router.body import UNKNOWN_CONTEXT_TOKENS, default_max_request_body_bytes
    from tandem.services.router.drain import Drain
    from tandem.services.router.grpc_server import start_grpc_server
    from tandem.services.router.metrics import RouterMetrics
    from tandem.services.router.response_store import (
        MemoryResponseStore,
        RedisResponseStore,
        ResponseStore,
    )

    # NOTE: the tokenizer comes from the model's files without torch: the router runs no
    # model (tests/unit/test_model_files.py holds its start-up to that). The context length
    # and vocabulary come from the engines (GetLoad), which serve what they loaded.
    tokenizer = load_tokenizer(cfg.model)
    name = model_id_of(cfg.model)
    served = _served_names(cfg, name)
    discovery = _discovery(cfg, name)
    metrics = RouterMetrics(served[0], cfg.metrics_window_s)
    view, store_index, events = _cache_view(cfg, discovery, metrics)
    tracing = start_tracing(cfg.tracing)
    if tracing.enabled:
        metrics.registry.register(tracing)
    fe = _frontend(cfg, tokenizer, served, discovery, metrics, view, tracing, defaults)
    pool = fe.pipeline.pool
    # NOTE: fixed at start-up, before any engine reported its context length: sized for
    # --max-model-len where given, else for the largest context an engine may serve.
    max_body = cfg.max_request_body_bytes or default_max_request_body_bytes(
        cfg.max_model_len or UNKNOWN_CONTEXT_TOKENS)
    response_store: ResponseStore = (
        RedisResponseStore(cfg.response_store_url, cfg.response_ttl_s)
        if cfg.response_store_url else MemoryResponseStore(cfg.response_ttl_s))
    tenancy = _tenancy(cfg, metrics)
    await discovery.start()
    await pool.start()
    if events is not None:
        metrics.registry.register(events)
        await events.start()
    grpc_server: Any = None
    try:
        if cfg.grpc_port:
            grpc_server = await start_grpc_server(fe, cfg.grpc_port, cfg.host,
                                                  max_message_bytes=max_body, tenancy=tenancy)
        drain = Drain()
        app = create_app(fe, max_request_body_bytes=max_body, drain=drain,
                         response_store=response_store, tenancy=tenancy)
        logger.info("router: http://%s:%d (OpenAI API), grpc %s:%d, model %s", cfg.host,
                    cfg.port, cfg.host, cfg.grpc_port, served[0])
        await _serve_http(cfg, app, drain)
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        await pool.close()
        await discovery.stop()
        if events is not None:
            await events.stop()
        if store_index is not None:
            await store_index.aclose()
        await response_store.aclose()
        if tenancy is not None:
            await tenancy.limiter.aclose()
        tracing.shutdown()  # exports what is queued


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem router`. Returns the exit code."""
    args = build_parser().parse_args(argv)
    from tandem.engine.generation_config import load_sampling_defaults
    from tandem.engine.model_files import resolve_model_path  # no torch: files only

    try:
        cfg = RouterConfig.from_args(args, os.environ)
        folder, gguf = resolve_model_path(cfg.model)
        defaults = load_sampling_defaults(cfg.generation_config,
                                          None if gguf is not None else folder)
    except ValueError as exc:
        print(f"tandem router: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if defaults.source is not None:
        logger.info("default sampling values from %s: %s (a request's own values win; "
                    "--generation-config vllm ignores the file)", defaults.source,
                    defaults.overridden())
    try:
        event_loop_runner(cfg.loop)(serve(cfg, defaults))
    except KeyboardInterrupt:
        pass
    return 0


def event_loop_runner(name: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """What runs the router's main coroutine for ``--loop NAME``: ``asyncio.run`` or
    ``uvloop.run``.

    ``auto`` is uvloop when it is installed: much of the router's work per streamed token
    is the loop's own (socket writes, task switches, polling; docs/benchmarks.md,
    "The router's own ceiling").

    Raises:
        ImportError: ``uvloop`` asked for and not installed.
    """
    if name == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if name == "uvloop":
            raise
        return asyncio.run
    return uvloop.run


if __name__ == "__main__":
    sys.exit(main())
