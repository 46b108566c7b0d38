"""Every flag the commands had before their options were generated from the config
dataclasses (``contracts/config_args.py``, ``engine/engine_args.py``) is still there, with
the same value form (metavar or choices), and the engine flags keep their meaning: each one
lands in the config field it set before.

The tables were read from ``tandem <command> --help`` of the hand-written parsers. Flags
added since are allowed (a command may grow); a flag that disappears or changes its form
fails here, as it would break the Helm chart and scripts that pass it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from help_options import help_options

from tandem.bench.throughput_args import parse_args as bench_throughput_args
from tandem.contracts.role import Role
from tandem.engine.config import (
    CacheConfig,
    CompilationConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tandem.kvstore.config import StoreConnectorConfig
from tandem.services.common.server import build_engine_config, build_parser
from tandem.services.router.config import RouterConfig
from tandem.services.router.main import build_parser as router_parser

ENGINE: dict[str, str] = {
    "--listen": "LISTEN",
    "--model": "MODEL",
    "--redis-url": "REDIS_URL",
    "--advertise-address": "ADVERTISE_ADDRESS",
    "--dtype": "{auto,float32,bfloat16,float16}",
    "--kv-cache-dtype": "{auto,fp8,fp8_e4m3,fp8_e5m2}",
    "--quantization": "{gptq,awq,compressed-tensors,fp8,int8,int4,gguf,none}",
    "-q": "{gptq,awq,compressed-tensors,fp8,int8,int4,gguf,none}",
    "--model-impl": "{auto,tandem,transformers}",
    "--device": "DEVICE",
    "--max-model-len": "MAX_MODEL_LEN",
    "--block-size": "BLOCK_SIZE",
    "--max-num-batched-tokens": "MAX_NUM_BATCHED_TOKENS",
    "--max-num-seqs": "MAX_NUM_SEQS",
    "--scheduling-policy": "{fcfs,priority}",
    "--long-prefill-token-threshold": "LONG_PREFILL_TOKEN_THRESHOLD",
    "--kv-cache-memory": "KV_CACHE_MEMORY",
    "--num-kv-blocks": "NUM_KV_BLOCKS",
    "--gpu-memory-utilization": "FRACTION",
    "--kvstore": "KVSTORE",
    "--kv-load-from-store": "BOOL",
    "--kv-publish-output": "BOOL",
    "--kv-load-wait-s": "S",
    "--kvstore-timeout-s": "S",
    "--metrics-port": "METRICS_PORT",
    "--max-waiting": "MAX_WAITING",
    "--shutdown-grace-s": "SHUTDOWN_GRACE_S",
    "--instance-id": "INSTANCE_ID",
    "--seed": "SEED",
    "--speculative-config": "JSON",
    "--deterministic": "",
    "--enforce-eager": "",
    "--cuda-graph-sizes": "N [N ...]",
    "--max-cudagraph-capture-size": "N",
    "--tensor-parallel-size": "TENSOR_PARALLEL_SIZE",
    "-tp": "TENSOR_PARALLEL_SIZE",
    "--pipeline-parallel-size": "PIPELINE_PARALLEL_SIZE",
    "-pp": "PIPELINE_PARALLEL_SIZE",
    "--enable-expert-parallel": "",
    "--distributed-executor-backend": "{uni,mp}",
    "--shared-cpu-lock": "PATH",
    "--log-level": "LOG_LEVEL",
    "--tls-cert": "TLS_CERT",
    "--tls-key": "TLS_KEY",
    "--tls-ca": "TLS_CA",
}
ROUTER: dict[str, str] = {
    "--host": "HOST",
    "--port": "PORT",
    "--grpc-port": "GRPC_PORT",
    "--model": "MODEL",
    "--served-model-name": "SERVED_MODEL_NAME",
    "--redis-url": "REDIS_URL",
    "--prefill": "PREFILL",
    "--decode": "DECODE",
    "--colocated": "COLOCATED",
    "--routing-policy": "{round_robin,least_loaded,kv_aware}",
    "--api-key": "API_KEY",
    "--api-keys": "FILE",
    "--rate-limit-url": "RATE_LIMIT_URL",
    "--max-model-len": "MAX_MODEL_LEN",
    "--max-running-requests": "MAX_RUNNING_REQUESTS",
    "--max-queued-requests": "MAX_QUEUED_REQUESTS",
    "--max-attempts": "MAX_ATTEMPTS",
    "--chat-template": "CHAT_TEMPLATE",
    "--generation-config": "GENERATION_CONFIG",
    "--tool-call-parser": "{hermes}",
    "--reasoning-parser": "{deepseek_r1,qwen3}",
    "--max-request-body-bytes": "MAX_REQUEST_BODY_BYTES",
    "--max-migrations": "MAX_MIGRATIONS",
    "--shutdown-grace-s": "SHUTDOWN_GRACE_S",
    "--tls-cert": "TLS_CERT",
    "--tls-key": "TLS_KEY",
    "--tls-ca": "TLS_CA",
    "--tls-server-name": "TLS_SERVER_NAME",
    "--kv-index-url": "KV_INDEX_URL",
    "--disagg-min-uncached-tokens": "DISAGG_MIN_UNCACHED_TOKENS",
    "--disagg-max-prefill-queue": "DISAGG_MAX_PREFILL_QUEUE",
    "--disagg-prefill-fallback": "",
    "--no-disagg-prefill-fallback": "",
    "--response-store-url": "RESPONSE_STORE_URL",
    "--response-ttl-s": "RESPONSE_TTL_S",
    "--log-level": "LOG_LEVEL",
    "--loop": "{auto,asyncio,uvloop}",
    "--http": "{auto,h11,httptools}",
}
BENCH_THROUGHPUT: dict[str, str] = {
    "--backend": "{tandem,hf,llama.cpp}",
    "--model": "MODEL",
    "--num-prompts": "NUM_PROMPTS",
    "--input-len": "INPUT_LEN",
    "--output-len": "OUTPUT_LEN",
    "--dtype": "{auto,float32,bfloat16}",
    "--quantization": "{gptq,awq,compressed-tensors,fp8,int8,int4,gguf,none}",
    "--kv-cache-dtype": "{auto,fp8,fp8_e4m3,fp8_e5m2}",
    "--kv-cache-memory": "KV_CACHE_MEMORY",
    "--model-impl": "{auto,tandem,transformers}",
    "--device": "DEVICE",
    "--enforce-eager": "",
    "--gpu-memory-utilization": "FRACTION",
    "--seed": "SEED",
    "--max-num-seqs": "MAX_NUM_SEQS",
    "--max-num-batched-tokens": "MAX_NUM_BATCHED_TOKENS",
    "--hf-batch-size": "HF_BATCH_SIZE",
    "--threads": "THREADS",
    "--repeat": "REPEAT",
    "--structured": "{json}",
    "--speculative-config": "JSON",
    "--deterministic": "",
    "--tensor-parallel-size": "TENSOR_PARALLEL_SIZE",
    "--pipeline-parallel-size": "PIPELINE_PARALLEL_SIZE",
    "--max-concurrent-batches": "MAX_CONCURRENT_BATCHES",
    "--prompt-pattern": "{random,repeated}",
    "--temperature": "TEMPERATURE",
    "--json": "JSON_PATH",
}


#: What the generated parsers changed on purpose: bench throughput's --dtype takes the
#: engine's float16 too, and its --quantization the engine's -q alias.
BENCH_THROUGHPUT_CHANGED = {"--dtype": "{auto,float32,bfloat16,float16}"}


def _missing_or_changed(before: dict[str, str], now: dict[str, str]) -> dict[str, tuple]:
    return {k: (v, now.get(k)) for k, v in before.items() if now.get(k) != v}


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE, None])
def test_engine_commands_keep_every_flag(role: Role | None) -> None:
    now = help_options(build_parser("tandem x", role).format_help())
    expected = dict(ENGINE)
    if role is None:
        expected["--role"] = "{prefill,decode,both}"
    assert _missing_or_changed(expected, now) == {}


def test_router_keeps_every_flag() -> None:
    assert _missing_or_changed(ROUTER, help_options(router_parser().format_help())) == {}


def test_bench_throughput_keeps_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_throughput_args(["--help"])
    assert exit_info.value.code == 0
    expected = {**BENCH_THROUGHPUT, **BENCH_THROUGHPUT_CHANGED}
    assert _missing_or_changed(expected, help_options(capsys.readouterr().out)) == {}


def test_engine_flags_land_in_the_fields_they_set() -> None:
    """Every engine flag given a non-default value: each lands in its field, as the
    hand-written ``build_engine_config`` put it."""
    ns = build_parser("tandem decode", Role.DECODE).parse_args(
        [
            "--redis-url",
            "redis://h:1",
            "--model",
            "/m",
            "--dtype",
            "float16",
            "--kv-cache-dtype",
            "fp8_e5m2",
            "-q",
            "int8",
            "--model-impl",
            "transformers",
            "--device",
            "cpu",
            "--max-model-len",
            "77",
            "--block-size",
            "32",
            "--max-num-batched-tokens",
            "99",
            "--max-num-seqs",
            "7",
            "--scheduling-policy",
            "priority",
            "--long-prefill-token-threshold",
            "64",
            "--kv-cache-memory",
            "12345",
            "--num-kv-blocks",
            "11",
            "--gpu-memory-utilization",
            "0.5",
            "--kvstore",
            "h:2",
            "--kv-load-from-store",
            "off",
            "--kv-publish-output=false",
            "--kv-load-wait-s",
            "0.5",
            "--kvstore-timeout-s",
            "3",
            "--seed",
            "5",
            "--enforce-eager",
            "--cuda-graph-sizes",
            "4",
            "2",
            "--max-cudagraph-capture-size",
            "8",
            "-tp",
            "2",
            "-pp",
            "1",
            "--enable-expert-parallel",
            "--distributed-executor-backend",
            "mp",
        ]
    )
    config = build_engine_config(ns, Role.DECODE)
    assert config.model == ModelConfig(
        model="/m",
        dtype="float16",
        device="cpu",
        max_model_len=77,
        seed=5,
        enforce_eager=True,
        model_impl="transformers",
        quantization="int8",
    )
    assert config.cache == CacheConfig(
        block_size=32,
        kv_cache_memory_bytes=12345,
        gpu_memory_utilization=0.5,
        num_blocks_override=11,
        cache_dtype="fp8_e5m2",
    )
    assert config.scheduler == SchedulerConfig(
        max_num_batched_tokens=99,
        max_num_seqs=7,
        policy="priority",
        long_prefill_token_threshold=64,
    )
    assert config.parallel == ParallelConfig(
        tensor_parallel_size=2, enable_expert_parallel=True, distributed_executor_backend="mp"
    )
    assert config.compilation == CompilationConfig(
        cudagraph_capture_sizes=(2, 4), max_cudagraph_capture_size=8
    )
    store = config.kv_transfer.connector_config
    assert isinstance(store, StoreConnectorConfig)
    assert (
        store.redis_url,
        store.kvstore_address,
        store.load_from_store,
        store.publish_output,
        store.kv_load_wait_s,
        store.kvstore_timeout_s,
    ) == ("redis://h:1", "h:2", False, False, 0.5, 3.0)
    assert config.kv_transfer.kv_role == "kv_consumer"


def test_engine_flag_defaults_are_the_configs() -> None:
    """No flag restates a default: the flags' config with none given is the configs' own."""
    config = build_engine_config(
        build_parser("tandem serve", None).parse_args(["--role", "both"]), Role.BOTH
    )
    assert (
        config.model,
        config.cache,
        config.scheduler,
        config.parallel,
        config.compilation,
        config.speculative,
    ) == (
        ModelConfig(),
        CacheConfig(),
        SchedulerConfig(),
        ParallelConfig(),
        CompilationConfig(),
        None,
    )


def test_router_flag_defaults_are_the_config() -> None:
    """The router's flags restate no default: none given builds ``RouterConfig``'s own."""
    ns = router_parser().parse_args(["--colocated", "h:1"])
    config = RouterConfig.from_args(ns, {})
    expected = RouterConfig(colocated=("h:1",))
    assert replace(config, tracing=expected.tracing) == expected
