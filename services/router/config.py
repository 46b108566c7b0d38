"""The router's configuration: one frozen value built once by ``tandem router``'s entry point
from its flags and environment, validated here."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.contracts.config_args import config_from_args, flag
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

    host: str = field(default="0.0.0.0", metadata=flag(
        "HTTP and gRPC bind address"))
    port: int = field(default=8000, metadata=flag(
        "HTTP port (OpenAI API, /metrics)"))
    grpc_port: int = field(default=50051, metadata=flag(
        "public gRPC GenerationService port (0 disables it)"))
    model: str | None = field(default=None, metadata=flag(
        "model path (GGUF file or HF folder); default: SmolLM2-135M-Instruct"))
    served_model_name: str | None = field(default=None, metadata=flag(
        "name clients pass as `model` (default: the model's file/folder name)"))
    redis_url: str | None = field(default=None, metadata=flag(
        "instance registry, redis://host:port"))
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()
    routing_policy: RoutingPolicy = field(default=RoutingPolicy.KV_AWARE, metadata=flag(
        "how prefill and decode instances are chosen"))
    api_key: str | None = field(default=None, metadata=flag(
        "require `Authorization: Bearer KEY` (default: $TANDEM_API_KEY)"))
    api_keys: KeyTable | None = None
    rate_limit_url: str | None = field(default=None, metadata=flag(
        "Redis where --api-keys limits are counted, shared by every replica "
        "(default: --redis-url; without either: each router counts its own)"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "cap on the context length in tokens (default: the smallest "
        "--max-model-len of the engines serving the model, as they report it)"))
    max_running_requests: int = field(default=256, metadata=flag(
        "requests in flight through the router at once"))
    max_queued_requests: int = field(default=1024, metadata=flag(
        "requests queued behind those; more get 503 + Retry-After"))
    max_attempts: int = field(default=3, metadata=flag(
        "tries per stage (prefill, decode) on different instances"))
    max_migrations: int = field(default=3, metadata=flag(
        "times one completion may continue on another decode instance after "
        "the one streaming it failed mid-stream (0: end it with an error event)"))
    chat_template: str | None = field(default=None, metadata=flag(
        "chat template for every request: a Jinja file, a shipped template's "
        "name (hermes_tool_use) or the template itself; default the model's"))
    tool_call_parser: str = field(default="hermes", metadata=flag(
        "how tool calls are read from the model's text (hermes: "
        "<tool_call>{json}</tool_call>)", choices=("hermes",)))
    reasoning_parser: str | None = field(default=None, metadata=flag(
        "split <think>...</think> thinking off chat answers into "
        "reasoning_content (Responses: a reasoning item; Messages: thinking blocks): "
        "deepseek_r1 (the output starts in the thinking) or qwen3 (explicit tags; "
        "enable_thinking: false turns it off); default none", choices=REASONING_PARSERS))
    generation_config: str = field(default="auto", metadata=flag(
        "default sampling values of requests that leave them unset: 'auto' "
        "(the model folder's generation_config.json: temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens), 'vllm' (the API's own defaults) or a "
        "folder holding a generation_config.json"))
    max_request_body_bytes: int | None = field(default=None, metadata=flag(
        "largest request accepted, in bytes: HTTP bodies (413 beyond) and "
        "public gRPC messages (default: 8 MiB + 32 bytes per token of --max-model-len, "
        "or of a 128K context without it)"))
    shutdown_grace_s: float = field(default=8.0, metadata=flag(
        "on SIGTERM: seconds open requests get to finish; then streams end "
        "with an error event and [DONE] (default 8, below tandem up's 10 s)"))
    tls: TLSFiles = field(default_factory=TLSFiles)
    kv_index_url: str | None = field(default=None, metadata=flag(
        "Redis of the KV store index that routing reads (default: --redis-url; "
        "with static lists and no URL the store is not consulted)"))
    disagg_min_uncached_tokens: int = field(default=0, metadata=flag(
        "a prompt with fewer uncached tokens (after the decode instance's "
        "and the store's cache) is prefilled on the decode instance, skipping the "
        "prefill hop; 0: always disaggregate"))
    disagg_max_prefill_queue: int = field(default=0, metadata=flag(
        "when the least loaded prefill instance already has this many "
        "prefills outstanding, the decode instance prefills the prompt itself "
        "(Dynamo's max_prefill_queue_size); 0: off"))
    disagg_prefill_fallback: bool = field(default=True, metadata=flag(
        "with no prefill instance able to serve (none up, or every Prefill "
        "attempt failed), a decode instance prefills the prompt itself instead of the "
        "request failing with 503 (default: on)"))
    response_store_url: str | None = field(default=None, metadata=flag(
        "Redis where /v1/responses keeps stored responses for "
        "previous_response_id, shared by every replica (default: --redis-url; without "
        "either: this router's memory only)"))
    response_ttl_s: int = field(default=3600, metadata=flag(
        "seconds a stored /v1/responses response is kept (default 3600)"))
    metrics_window_s: float = field(default=60.0, metadata=flag(
        "seconds of the sliding window of the TTFT and inter-token latency "
        "percentiles (p50/p90/p99 gauges) on /metrics (default 60)"))
    log_level: str = field(default="info", metadata=flag(
        "Python logging level (debug, info, warning, error)"))
    tracing: TracingConfig = field(
        default_factory=lambda: TracingConfig(service_name="tandem-router"))
    loop: str = field(default="auto", metadata=flag(
        "event loop (auto: uvloop when installed)", choices=("auto", "asyncio", "uvloop")))
    http: str = field(default="auto", metadata=flag(
        "HTTP/1.1 implementation (auto: httptools when installed)",
        choices=("auto", "h11", "httptools")))

    def __post_init__(self) -> None:
        if self.loop not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"--loop must be auto, asyncio or uvloop, got {self.loop!r}")
        if self.http not in ("auto", "h11", "httptools"):
            raise ValueError(f"--http must be auto, h11 or httptools, got {self.http!r}")
        for option, port in (("--port", self.port), ("--grpc-port", self.grpc_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{option} must be in 0..65535, got {port}")
        for option, value in (("--max-running-requests", self.max_running_requests),
                              ("--max-attempts", self.max_attempts)):
            if value < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
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
        redis_url = ns.redis_url or None
        return config_from_args(
            cls, ns, redis_url=redis_url, prefill=_split(ns.prefill), decode=_split(ns.decode),
            colocated=_split(ns.colocated),
            api_key=ns.api_key or environ.get("TANDEM_API_KEY") or None,
            api_keys=load_key_table(ns.api_keys) if ns.api_keys else None,
            rate_limit_url=ns.rate_limit_url or redis_url,
            reasoning_parser=ns.reasoning_parser or None,
            kv_index_url=ns.kv_index_url or redis_url,
            response_store_url=ns.response_store_url or redis_url,
            tls=tls_from_args(ns),
            tracing=TracingConfig.from_args(ns, environ, "tandem-router"))
