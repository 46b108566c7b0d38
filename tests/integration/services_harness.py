"""Helpers of the services tests: real processes (engine services, KV store) and oracles.

Every process is started with ``python -P -m tandem.cli ...`` and stopped (SIGTERM,
then SIGKILL) by its owner's fixture teardown. Readiness is polled with a deadline
(gRPC health SERVING), never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from ports import free_port
from waiting import wait_until

from tandem.launch import (
    Part,
    StackError,
    grpc_serving,
    http_ok,
    start_part,
    stop_parts,
    tandem_argv,
    wait_ready,
)
from tandem.services.decode.client import DecodeCall
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def wait_for(cond: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll ``cond`` until it returns a truthy value (returned) or fail after ``timeout_s``."""
    return wait_until(cond, timeout_s, what, interval_s=poll_s)


def make_tiny_model(folder: Path, tokenizer_dir: Path | None = None) -> Path:
    """Save a tiny random-weight Llama (float32, safetensors) with a tokenizer as an HF folder.

    The tokenizer is SmolLM2's (saved once into ``tokenizer_dir`` and copied), so
    the folder loads like any local model; the vocabulary is 49152 tokens.
    """
    import shutil

    from tiny_models import tiny_config, tiny_hf_model

    from tandem.engine.model_files import load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    # NOTE: weights larger than the default 0.02 init (initializer_range) give varied
    # greedy tokens with clear argmax margins (the default repeats one token).
    config = tiny_config("LlamaForCausalLM", vocab=49152, hidden=64, ffn=128, max_len=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                         initializer_range=0.3)
    model = tiny_hf_model(config)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer_config.json").exists():
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
    else:
        tok = load_tokenizer(None)
        tok.save_pretrained(folder)
        if tokenizer_dir is not None:
            tok.save_pretrained(tokenizer_dir)
    return folder


def random_prompt(rng: random.Random | int, n: int) -> list[int]:
    """``n`` token ids drawn from ``rng`` (or a ``random.Random`` seeded with it) among
    the tiny model's ids 3..49151 (below 3: its BOS/EOS/pad)."""
    if isinstance(rng, int):
        rng = random.Random(rng)
    return [rng.randrange(3, 49152) for _ in range(n)]


def hf_greedy(model_dir: str | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: transformers ``generate(do_sample=False)`` in float32, one prompt at a time.

    Returns the generated ids (EOS included when it ended the sequence).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.model_files import resolve_model_path

    if model_dir is None:
        from hf_oracle import hf_default_model

        model = hf_default_model()
    else:
        folder, gguf = resolve_model_path(model_dir)
        kwargs = {"local_files_only": True, "dtype": torch.float32}
        if gguf is not None:
            kwargs["gguf_file"] = gguf
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.eos_token_id,
            )
            outs.append(gen[0, len(prompt):].tolist())
    return outs


class Proc:
    """A `tandem <cmd>` subprocess with its log file (a ``tandem.launch.Part``)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 ready: Callable[[], bool] = lambda: True) -> None:
        self.args = args
        self.log_path = log_path
        self.part = Part(args[0], tandem_argv(*args), ready)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = start_part(self.part, log_path=log_path, env=full_env, cwd=REPO)

    def wait_ready(self, timeout_s: float) -> None:
        """Until ``ready`` holds; stops the process and raises StackError (with the log tail)
        when it exits first or ``timeout_s`` passes."""
        try:
            wait_ready([self.part], timeout_s)
        except StackError:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def alive(self) -> bool:
        return self.part.alive()

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait, SIGKILL if needed; returns the exit code."""
        stop_parts([self.part], timeout_s)
        return self.popen.returncode

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(10)


class EngineService:
    """A running `tandem serve --role ...` process and blocking stubs to it."""

    def __init__(self, role: str, model: str | None, tmp: Path, redis_url: str | None,
                 extra: list[str] = (), startup_timeout_s: float = 180.0) -> None:
        self.role = role
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        args = ["serve", "--role", role, "--listen", self.address, "--dtype", "float32",
                "--log-level", "INFO", *extra]
        if model is not None:
            args += ["--model", model]
        if redis_url is not None:
            args += ["--redis-url", redis_url]
        self.proc = Proc(args, tmp / f"{role}-{self.port}.log",
                         ready=lambda: grpc_serving(self.address))
        if startup_timeout_s > 0:
            self.wait_ready(startup_timeout_s)

    def wait_ready(self, timeout_s: float = 180.0) -> EngineService:
        """Until the service serves (a service made with ``startup_timeout_s=0`` started
        without waiting, so that several start at once); returns it."""
        self.proc.wait_ready(timeout_s)
        self.channel = grpc.insecure_channel(self.address)
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        return self

    def get_load(self) -> common_pb2.GetLoadResponse:
        stub = self.prefill if self.role == "prefill" else self.decode
        return stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)

    def stop(self) -> int | None:
        self.channel.close()
        return self.proc.stop()


def params(max_tokens: int, **kw: object) -> common_pb2.SamplingParams:
    """Greedy sampling params by default."""
    kw.setdefault("temperature", 0.0)
    return common_pb2.SamplingParams(max_tokens=max_tokens, **kw)


def decode_request_from(prefill: prefill_pb2.PrefillResponse, prompt: list[int],
                        sp: common_pb2.SamplingParams) -> decode_pb2.DecodeRequest:
    """The Decode request a router sends after a Prefill (what H6's router does)."""
    req = decode_pb2.DecodeRequest(
        request_id=prefill.request_id,
        prompt_token_ids=prompt,
        first_token_id=prefill.first_token_id,
        block_hashes=prefill.block_hashes,
        sampling_params=sp,
        kv_layout_fingerprint=prefill.kv_layout_fingerprint,
        hash_algorithm=prefill.hash_algorithm,
        kv_publish_pending=prefill.kv_publish_pending,
    )
    return req


def wait_published(redis_url: str, pre: prefill_pb2.PrefillResponse, timeout_s: float = 30.0
                   ) -> None:
    """Until the store index holds every block of ``pre``: the prefill answers before its
    publish ends (``kv_publish_pending``), so a test that then touches the stored blocks
    waits for them first."""
    from tandem.contracts.block_key import BlockKey
    from tandem.kvstore.lookup import IndexProbe

    keys = [BlockKey(h, pre.kv_layout_fingerprint) for h in pre.block_hashes]
    probe = IndexProbe(redis_url, backoff_s=0)
    try:
        wait_for(lambda: probe.leading(keys) == len(keys), timeout_s,
                 f"the {len(keys)} blocks of {pre.request_id} in the store index")
    finally:
        probe.close()


def run_disaggregated(prefill: EngineService, decode: EngineService, prompt: list[int],
                      sp: common_pb2.SamplingParams, request_id: str = "") -> tuple[list[int], object]:
    """Prefill then Decode, like the router; returns (all generated ids, prefill response)."""
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt,
                                   sampling_params=sp), timeout=120)
    tokens = [pre.first_token_id]
    if pre.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
        return tokens, pre
    for msg in DecodeCall(decode.decode, decode_request_from(pre, prompt, sp), timeout=120):
        tokens.extend(msg.token_ids)
    return tokens, pre


def run_colocated(service: EngineService, prompt: list[int], sp: common_pb2.SamplingParams,
                  request_id: str = "") -> list[int]:
    """Decode without a first token: the whole generation in one engine."""
    tokens: list[int] = []
    req = decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                   sampling_params=sp)
    for msg in DecodeCall(service.decode, req, timeout=120):
        tokens.extend(msg.token_ids)
    return tokens


class KVStoreNode:
    """A running `tandem kvstore` process (UCX data plane, Redis index)."""

    def __init__(self, redis_url: str, tmp: Path, capacity_bytes: int = 256 << 20,
                 env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc = Proc(
            ["kvstore", "--listen", self.address, "--capacity", str(capacity_bytes),
             "--redis-url", redis_url, "--metrics-port", str(self.metrics_port), *extra_args],
            tmp / f"kvstore-{self.port}.log",
            env,
            ready=lambda: http_ok(f"http://127.0.0.1:{self.metrics_port}/health"),
        )
        self.proc.wait_ready(120)

    def stop(self) -> int | None:
        return self.proc.stop()


def tiny_model_dir(base: Path) -> Path:
    """The tiny model under ``base`` (pytest's session temp root), made once per session."""
    folder = base / "h5_tiny_llama"
    if not (folder / "model.safetensors").exists():
        make_tiny_model(folder, base / "h5_smollm2_tokenizer")
    return folder


def metric_value(metrics_port: int, name: str, **labels: str) -> float:
    """The value of the Prometheus sample ``name`` whose labels include ``labels`` on
    ``127.0.0.1:metrics_port/metrics`` (0.0 when there is none yet)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return 0.0


class MeteredEngine:
    """An :class:`EngineService` with a ``/metrics`` port, read by :meth:`metric`.

    Args:
        args: the engine's flags (``--metrics-port`` is added).
    """

    def __init__(self, role: str, model: str, tmp: Path, redis_url: str,
                 args: list[str]) -> None:
        self.metrics_port = free_port()
        self.svc = EngineService(role, model, tmp, redis_url,
                                 [*args, "--metrics-port", str(self.metrics_port)])

    def metric(self, name: str, **labels: str) -> float:
        """The metric now: a GetLoad first brings ``/metrics`` up to the engine's counts
        (otherwise they follow at the 2 s heartbeat, and a baseline read before a test's
        requests could miss an earlier test's)."""
        self.svc.get_load()
        return metric_value(self.metrics_port, name, **labels)

    def wait_metric(self, name: str, value: float, **labels: str) -> None:
        """Until the metric reads ``value`` (within 30 s)."""
        wait_for(lambda: self.metric(name, **labels) == value, 30,
                 f"{name}{labels} == {value} (is {self.metric(name, **labels)})")


@contextlib.contextmanager
def metered_engines(roles: tuple[str, ...], model: str, tmp: Path, redis_url: str,
                    args: list[str]) -> Iterator[list[MeteredEngine]]:
    """One :class:`MeteredEngine` per role, in order, all stopped on exit (also when one
    fails to start)."""
    started: list[MeteredEngine] = []
    try:
        for role in roles:
            started.append(MeteredEngine(role, model, tmp, redis_url, args))
        yield started
    finally:
        for inst in started:
            inst.svc.stop()


@contextlib.contextmanager
def grpc_servicer_in_thread(register: Callable[[object, grpc.aio.Server], None],
                            servicer: object) -> Iterator[str]:
    """Serve ``servicer`` (``register(servicer, server)``: a generated
    ``add_..._to_server``) on a free local port from an event loop in a daemon thread of
    the test process, so the test reads what it records; yields ``host:port``."""
    port = free_port()
    ready = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        server = grpc.aio.server()
        register(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        holder["stop"] = asyncio.Event()
        holder["loop"] = asyncio.get_running_loop()
        ready.set()
        await holder["stop"].wait()
        await server.stop(0)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the gRPC server did not start"
    try:
        yield f"127.0.0.1:{port}"
    finally:
        holder["loop"].call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
