"""The router's configuration: one frozen value built once by ``tandem router``'s entry point
from its flags and environment, validated here."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.contracts.tracing import TracingConfig
from tandem.services.common.tls import TLSFiles, tls_from_args
from tandem.services.router.reasoning import REASONING_PARSERS
from tandem.services.router.routing import RoutingPolicy
from tandem.services.router.tenants import KeyTable, load_key_table


def _split(value: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in value.split(",") if a.strip())


@dataclass(frozen=True)
class RouterConfig:
    """What ``tandem router`` serves and how (flag names in parentheses).

    Attributes:
        host: HTTP and gRPC bind address (``--host``).
        port: HTTP port (``--port``).
        grpc_port: public gRPC port, 0 disables it (``--grpc-port``).
        model: GGUF file or HF folder, ``None`` for the default model (``--model``).
        served_model_name: the name reported and accepted first (``--served-model-name``).
        redis_url: instance registry (``--redis-url``); exclusive with the static lists.
        prefill / decode / colocated: static instance addresses.
        routing_policy: how instances are chosen.
        api_key: required bearer token (``--api-key``, else ``$TANDEM_API_KEY``), or ``None``.
        api_keys: the API keys, their tenants and limits (``--api-keys FILE``, read here
            once: ``tenants.load_key_table``), or ``None``; exclusive with ``api_key``.
        rate_limit_url: Redis where the tenants' limits are counted, shared by every
            replica (``--rate-limit-url``, default ``redis_url``; ``None``: each router
            counts its own).
        max_model_len: cap on the context length in tokens, ``None`` for none: requests
            are validated against the smallest context length the engines report.
        max_running_requests / max_queued_requests: admission limits (requests).
        max_attempts: tries per stage on different instances.
        max_migrations: times one completion may move to another instance after the one
            streaming it failed mid-stream (``--max-migrations``; 0: the stream ends with
            an error event instead).
        chat_template: ``--chat-template`` as given (a path, a shipped template's name or
            the template), ``None`` for the model's.
        tool_call_parser: ``--tool-call-parser`` (``hermes``).
        reasoning_parser: ``--reasoning-parser`` (``deepseek_r1``, ``qwen3``: vLLM's names),
            ``None`` for none: chat answers' ``<think>`` text is then plain content.
        generation_config: ``--generation-config``: where requests' default sampling
            values come from (``auto``: the model folder's ``generation_config.json``;
            ``vllm``: the API's own; or a folder), vLLM's flag
            (``tandem.engine.generation_config``).
        max_request_body_bytes: largest HTTP request body and gRPC request message
            accepted (``--max-request-body-bytes``; 413 / RESOURCE_EXHAUSTED beyond),
            ``None`` for ``body.default_max_request_body_bytes`` of ``max_model_len`` (of
            ``body.UNKNOWN_CONTEXT_TOKENS`` without it).
        tls: TLS of the router's channels to the engines (``--tls-cert``/``--tls-key``/
            ``--tls-ca``: ``services/common/tls.py``), read from the files here.
        shutdown_grace_s: on SIGTERM, seconds open requests get to finish before they are
            ended with an error (``--shutdown-grace-s``; ``drain.Drain``).
        kv_index_url: Redis of the KV store index the kv_aware policy and conditional
            disaggregation read (``--kv-index-url``, default ``redis_url``; ``None``: the
            store is not consulted).
        disagg_min_uncached_tokens: a prompt with fewer uncached tokens than this on the
            chosen decode instance skips the prefill hop (``--disagg-min-uncached-tokens``;
            0: always disaggregate).
        disagg_max_prefill_queue: when the least loaded prefill instance already has this
            many prefills outstanding, the chosen decode instance prefills the prompt
            itself (``--disagg-max-prefill-queue``; Dynamo's ``max_prefill_queue_size``;
            0: off).
        disagg_prefill_fallback: with no prefill instance able to serve, decode instances
            prefill prompts themselves instead of requests failing with a 503
            (``--[no-]disagg-prefill-fallback``, on by default).
        response_store_url: Redis where ``/v1/responses`` keeps stored responses, so
            that every replica continues any conversation (``--response-store-url``,
            default ``redis_url``; ``None``: the router's own memory, one replica only).
        response_ttl_s: seconds a stored response is kept (``--response-ttl-s``).
        metrics_window_s: seconds of the sliding window of the TTFT and inter-token
            latency percentiles on ``/metrics`` (``--metrics-window-s``;
            ``scaling_metrics``).
        log_level: Python logging level name.
        tracing: OpenTelemetry export (``--otlp-traces-endpoint``,
            ``--otlp-traces-protocol``; ``contracts/tracing.py``), off by default.
        loop: the event loop (``--loop``, uvicorn's name): ``uvloop`` when installed for
            ``auto``, else ``asyncio``.
        http: the HTTP/1.1 implementation (``--http``, uvicorn's name): ``httptools``
            when installed for ``auto``, else ``h11``.

    Raises:
        ValueError: naming the flag, for a port outside 0..65535, a count below 1, both or neither instance sources, both ``--api-key`` and ``--api-keys``.
    """

    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051
    model: str | None = None
    served_model_name: str | None = None
    redis_url: str | None = None
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    api_key: str | None = None
    api_keys: KeyTable | None = None
    rate_limit_url: str | None = None
    max_model_len: int | None = None
    max_running_requests: int = 256
    max_queued_requests: int = 1024
    max_attempts: int = 3
    max_migrations: int = 3
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    generation_config: str = "auto"
    max_request_body_bytes: int | None = None
    shutdown_grace_s: float = 8.0
    tls: TLSFiles = field(default_factory=TLSFiles)
    kv_index_url: str | None = None
    disagg_min_uncached_tokens: int = 0
    disagg_max_prefill_queue: int = 0
    disagg_prefill_fallback: bool = True
    response_store_url: str | None = None
    response_ttl_s: int = 3600
    metrics_window_s: float = 60.0
    log_level: str = "info"
    tracing: TracingConfig = field(default_factory=TracingConfig)
    loop: str = "auto"
    http: str = "auto"

    def __post_init__(self) -> None:
        if self.loop not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"--loop must be auto, asyncio or uvloop, got {self.loop!r}")
        if self.http not in ("auto", "h11", "httptools"):
            raise ValueError(f"--http must be auto, h11 or httptools, got {self.http!r}")
        for flag, port in (("--port", self.port), ("--grpc-port", self.grpc_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be in 0..65535, got {port}")
        for flag, value in (("--max-running-requests", self.max_running_requests),
                            ("--max-attempts", self.max_attempts)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if self.disagg_min_uncached_tokens < 0:
            raise ValueError("--disagg-min-uncached-tokens must be >= 0, got "
                             f"{self.disagg_min_uncached_tokens}")
        if self.disagg_max_prefill_queue < 0:
            raise ValueError("--disagg-max-prefill-queue must be >= 0, got "
                             f"{self.disagg_max_prefill_queue}")
        if self.response_ttl_s < 1:
            raise ValueError(f"--response-ttl-s must be >= 1, got {self.response_ttl_s}")
        if not self.metrics_window_s > 0:
            raise ValueError(f"--metrics-window-s must be > 0, got {self.metrics_window_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got "
                             f"{self.max_queued_requests}")
        if self.tool_call_parser not in ("hermes",):
            raise ValueError(f"--tool-call-parser must be hermes, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}"
                             f", got {self.reasoning_parser!r}")
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got "
                             f"{self.max_request_body_bytes}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.api_key is not None and self.api_keys is not None:
            raise ValueError("--api-keys: give it or --api-key ($TANDEM_API_KEY), not both "
                             "(list that key in the --api-keys file instead)")
        static = self.prefill or self.decode or self.colocated
        if self.redis_url and static:
            raise ValueError("--redis-url: give it or static lists "
                             "(--prefill/--decode/--colocated), not both")
        if not self.redis_url and not static:
            raise ValueError("--redis-url: give it or --prefill/--decode/--colocated")

    @classmethod
    def from_args(cls, ns: argparse.Namespace, environ: Mapping[str, str]) -> RouterConfig:
        """From ``tandem router``'s parsed flags and its environment (read only here).

        Raises:
            ValueError: as the class; for an ``--api-keys`` file that cannot be read or
                is wrong, naming the entry and field (``tenants.load_key_table``).
        """
        return cls(host=ns.host, port=ns.port, grpc_port=ns.grpc_port, model=ns.model,
                   served_model_name=ns.served_model_name, redis_url=ns.redis_url or None,
                   prefill=_split(ns.prefill), decode=_split(ns.decode),
                   colocated=_split(ns.colocated),
                   routing_policy=RoutingPolicy(ns.routing_policy),
                   api_key=ns.api_key or environ.get("TANDEM_API_KEY") or None,
                   api_keys=(load_key_table(ns.api_keys) if getattr(ns, "api_keys", None)
                             else None),
                   rate_limit_url=(getattr(ns, "rate_limit_url", None) or ns.redis_url
                                   or None),
                   max_model_len=ns.max_model_len,
                   max_running_requests=ns.max_running_requests,
                   max_queued_requests=ns.max_queued_requests, max_attempts=ns.max_attempts,
                   max_migrations=ns.max_migrations,
                   chat_template=getattr(ns, "chat_template", None),
                   tool_call_parser=getattr(ns, "tool_call_parser", "hermes"),
                   reasoning_parser=getattr(ns, "reasoning_parser", None) or None,
                   generation_config=getattr(ns, "generation_config", "auto"),
                   max_request_body_bytes=ns.max_request_body_bytes,
                   shutdown_grace_s=ns.shutdown_grace_s, tls=tls_from_args(ns),
                   kv_index_url=getattr(ns, "kv_index_url", None) or ns.redis_url or None,
                   disagg_min_uncached_tokens=getattr(ns, "disagg_min_uncached_tokens", 0),
                   disagg_max_prefill_queue=getattr(ns, "disagg_max_prefill_queue", 0),
                   disagg_prefill_fallback=getattr(ns, "disagg_prefill_fallback", True),
                   response_store_url=(getattr(ns, "response_store_url", None)
                                       or ns.redis_url or None),
                   response_ttl_s=getattr(ns, "response_ttl_s", 3600),
                   metrics_window_s=ns.metrics_window_s,
                   log_level=ns.log_level, loop=getattr(ns, "loop", "auto"),
                   tracing=TracingConfig.from_args(ns, environ, "tandem-router"),
                   http=getattr(ns, "http", "auto"))
