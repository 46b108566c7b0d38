"""Disaggregation between engines of different tensor-parallel sizes, over real services,
a real KV store and Redis: a prefill at TP=2 publishes blocks that a decode at TP=1 loads,
and the reverse; the greedy output equals transformers' (float32). The store holds every
block in the full model's head layout, so both sides share keys.

And a decode service whose worker process is killed mid-stream fails its streams with
UNAVAILABLE instead of hanging in a collective, and exits: behind a router, they continue
on another instance.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
from services_harness import (
    EngineService,
    Proc,
    hf_greedy,
    metric_value,
    params,
    random_prompt,
    run_disaggregated,
)
from waiting import wait_until

from tandem.launch import free_port, http_ok
from tandem.v1 import prefill_pb2

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "128", "--block-size", "16"]
TP2 = [*ENGINE_ARGS, "--tensor-parallel-size", "2"]

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module")
def services(tiny, redis_url, store, tmp_path_factory):
    """Prefill and decode at TP=1 and at TP=2, started at once (each waits for its
    model load; four in a row would wait four times)."""
    tmp = tmp_path_factory.mktemp("parallel")
    made = {(role, tp): EngineService(role, tiny, tmp, redis_url, TP2 if tp == 2 else ENGINE_ARGS,
                                      startup_timeout_s=0)
            for role in ("prefill", "decode") for tp in (1, 2)}
    try:
        for svc in made.values():
            svc.wait_ready(240)
        yield made
    finally:
        for svc in made.values():
            if svc.proc.alive():
                svc.proc.stop()


def _workers(svc: EngineService) -> list[psutil.Process]:
    """The service's worker processes (multiprocessing "spawn" children)."""
    kids = psutil.Process(svc.proc.popen.pid).children()
    return [k for k in kids if "spawn_main" in " ".join(k.cmdline())]


def test_prefill_and_decode_at_different_tensor_parallel_sizes(tiny, services):
    prefill, decode = services["prefill", 1], services["decode", 1]
    prefill_tp2, decode_tp2 = services["prefill", 2], services["decode", 2]
    assert len(_workers(prefill_tp2)) == 2 and len(_workers(decode_tp2)) == 2
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (16, 37, 100)]
    expected = hf_greedy(tiny, prompts, max_new_tokens=8)
    for prompt, want in zip(prompts, expected, strict=True):
        for pre, dec, what in ((prefill_tp2, decode, "TP2 -> TP1"),
                               (prefill, decode_tp2, "TP1 -> TP2")):
            got, presp = run_disaggregated(pre, dec, prompt, params(8))
            assert got == want, f"{what}, prompt of {len(prompt)} tokens"
    # The same layout fingerprint on both sides: one set of keys in the store.
    a = prefill_tp2.prefill.Prefill(prefill_pb2.PrefillRequest(
        prompt_token_ids=prompts[0], sampling_params=params(1)), timeout=60)
    b = prefill.prefill.Prefill(prefill_pb2.PrefillRequest(
        prompt_token_ids=prompts[0], sampling_params=params(1)), timeout=60)
    assert a.kv_layout_fingerprint == b.kv_layout_fingerprint


def test_router_moves_streams_off_a_decode_whose_worker_died(tiny, services, tmp_path):
    """Two greedy streams through a router (round robin over a TP=2 and a TP=1 decode);
    a worker of the TP=2 engine is killed mid-stream: its stream continues on the TP=1
    instance (request migration) and both end with the uninterrupted text."""
    decode_tp2, decode = services["decode", 2], services["decode", 1]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = Proc(["router", "--port", str(port), "--grpc-port", "0", "--model", tiny,
                   "--prefill", services["prefill", 1].address,
                   "--decode", f"{decode_tp2.address},{decode.address}",
                   "--routing-policy", "round_robin", "--max-model-len", "1024"],
                  tmp_path / "router.log", ready=lambda: http_ok(f"{url}/ready"))
    try:
        router.wait_ready(120)
        body = {"model": httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"],
                "prompt": "one two three four", "max_tokens": 300, "temperature": 0.0,
                "ignore_eos": True}
        want = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        want_text = want["choices"][0]["text"]
        workers = _workers(decode_tp2)

        async def stream(http: httpx.AsyncClient, first: asyncio.Event) -> tuple[str, dict]:
            text, final = [], {}
            async with http.stream("POST", f"{url}/v1/completions",
                                   json={**body, "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text.append(event["choices"][0]["text"])
                    if event["choices"][0]["finish_reason"]:
                        final = event
                    if len(text) >= 10:  # the decode instance is streaming, not the prefill
                        first.set()
            return "".join(text), final

        async def run() -> list[tuple[str, dict]]:
            async with httpx.AsyncClient(timeout=120) as http:
                firsts = [asyncio.Event(), asyncio.Event()]
                tasks = [asyncio.create_task(stream(http, f)) for f in firsts]
                for f in firsts:
                    await asyncio.wait_for(f.wait(), 60)
                workers[1].send_signal(signal.SIGKILL)
                return list(await asyncio.gather(*tasks))

        results = asyncio.run(run())
        assert [text for text, _ in results] == [want_text, want_text]
        timings = [final["timings"] for _, final in results]
        # Round robin put one stream on each instance; the TP=2 one moved to TP=1.
        assert sorted(t.get("num_migrations", 0) for t in timings) == [0, 1], timings
        assert {t["decode_instance"] for t in timings} == {decode.address}, timings
        assert metric_value(port, "tandem:router_request_migrations_total") == 1
        assert decode_tp2.proc.popen.wait(60) == 1
        wait_until(lambda: not any(w.is_running() for w in workers), 30, "workers gone")
    finally:
        router.stop()


def test_more_workers_than_cpus_is_a_usage_error(tiny):
    n = len(os.sched_getaffinity(0)) + 1
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "--role", "both", "--listen",
         "127.0.0.1:0", "--model", tiny, "--tensor-parallel-size", str(n)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"tensor_parallel_size x pipeline_parallel_size = {n} workers exceed" in done.stderr
    assert "Traceback" not in done.stderr


def test_heads_tp_does_not_divide_is_a_usage_error_without_a_traceback(tiny, tmp_path):
    """A worker's start-up ValueError (its shard of the heads) reaches the user as the
    service's one-line usage error (exit 2), with no worker traceback on stderr."""
    import shutil

    folder = tmp_path / "one_head"
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_attention_heads=1, num_key_value_heads=1, head_dim=cfg["hidden_size"])
    (folder / "config.json").write_text(json.dumps(cfg))
    done = subprocess.run(
        [sys.executable, "-P", "-m", "tandem.cli", "serve", "--role", "both", "--listen",
         "127.0.0.1:0", "--model", str(folder), "--tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "tensor_parallel_size 2" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_config_transformers_rejects_is_a_usage_error(tiny, tmp_path):
    """A config.json whose sizes contradict each other (hidden 64 over 3 heads) is refused
    as bad input naming the model (transformers raises a non-ValueError for it)."""
    import shutil

    folder = tmp_path / "bad_config"
    shutil.copytree(tiny, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_attention_heads=3, num_key_value_heads=3)
    cfg.pop("head_dim", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    done = subprocess.run(
        [sys.executable, "-P", "-m", "tandem.cli", "serve", "--role", "both", "--listen",
         "127.0.0.1:0", "--model", str(folder)],
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "its config is invalid" in done.stderr and "Traceback" not in done.stderr, (
        done.stderr[-2000:])
