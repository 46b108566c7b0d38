"""The KV store as a shared cache tier, over real services: two prefill instances, one
decode, one store node, real Redis. Tiny random Llama in float32; the oracle is
transformers ``generate(do_sample=False)``.

Prompts are token ids (the gRPC API): turn 2 of a conversation is built from turn 1's
prompt and generated ids, so its block hashes match what the decode side published
(the chat path's re-tokenisation of the answer is not exercised here).
"""

from __future__ import annotations

import random

import pytest
from ports import free_port
from services_harness import (
    hf_greedy,
    metered_engines,
    params,
    random_prompt,
    run_disaggregated,
)

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]
BS = 16


@pytest.fixture(scope="module")
def cluster(tiny, redis_url, store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tier")
    with metered_engines(("prefill", "prefill", "decode"), tiny, tmp, redis_url,
                         ENGINE_ARGS) as started:
        yield started


def test_prefill_b_loads_what_prefill_a_computed(tiny, cluster):
    a, b, decode = cluster
    rng = random.Random(19)
    prompt = random_prompt(rng, 100)  # 6 full blocks and a partial one
    longer = prompt + random_prompt(rng, 45)
    want, want_longer = hf_greedy(tiny, [prompt, longer], max_new_tokens=8)

    got, pre = run_disaggregated(a.svc, decode.svc, prompt, params(8))
    assert got == want
    assert pre.num_cached_tokens == 0

    # B has never seen the prefix: it loads A's 6 full blocks from the store.
    got, pre = run_disaggregated(b.svc, decode.svc, longer, params(8))
    assert got == want_longer
    assert pre.num_cached_tokens == 96
    b.wait_metric("tandem:prefix_cache_hits_total", 96, tier="store")
    assert b.metric("tandem:prefix_cache_hits_total", tier="local") == 0
    b.wait_metric("tandem:prefix_cache_queries_total", len(longer), tier="store")

    # The same prompt again on B: the loaded blocks are in B's prefix cache now.
    got, pre = run_disaggregated(b.svc, decode.svc, prompt, params(8))
    assert got == want
    assert pre.num_cached_tokens == 96
    b.wait_metric("tandem:prefix_cache_hits_total", 96, tier="local")
    assert b.metric("tandem:prefix_cache_hits_total", tier="store") == 96


def test_turn_2_on_another_prefill_loads_turn_1_prompt_and_answer(tiny, cluster):
    a, b, decode = cluster
    rng = random.Random(20)
    turn1 = random_prompt(rng, 40)
    want1 = hf_greedy(tiny, [turn1], max_new_tokens=30)[0]
    published = decode.metric("tandem:kv_output_publishes_total", outcome="ok")
    got1, _ = run_disaggregated(a.svc, decode.svc, turn1, params(30))
    assert got1 == want1 and len(got1) == 30
    # The decode publishes after its stream ended: wait for it, not for a time.
    decode.wait_metric("tandem:kv_output_publishes_total", published + 1, outcome="ok")

    turn2 = turn1 + got1 + random_prompt(rng, 20)
    want2 = hf_greedy(tiny, [turn2], max_new_tokens=8)[0]
    store_before = b.metric("tandem:prefix_cache_hits_total", tier="store")
    got2, pre = run_disaggregated(b.svc, decode.svc, turn2, params(8))
    assert got2 == want2
    # KV exists for turn 1's prompt and all but the last generated token: 69 tokens,
    # 4 full blocks, all from the store (B never saw turn 1).
    assert pre.num_cached_tokens == (len(turn1) + len(got1) - 1) // BS * BS == 64
    b.wait_metric("tandem:prefix_cache_hits_total", store_before + 64, tier="store")


def test_a_decode_instance_prefilling_itself_loads_from_the_store(tiny, redis_url, cluster):
    from services_harness import run_colocated, wait_published

    from tandem.v1 import prefill_pb2

    a, _, decode = cluster
    rng = random.Random(21)
    prompt = random_prompt(rng, 70)  # 4 full blocks
    pre = a.svc.prefill.Prefill(prefill_pb2.PrefillRequest(
        prompt_token_ids=prompt, sampling_params=params(1)), timeout=60)
    wait_published(redis_url, pre)  # the prefill answers before its publish ends
    longer = prompt + random_prompt(rng, 10)
    before = decode.metric("tandem:prefix_cache_hits_total", tier="store")
    assert run_colocated(decode.svc, longer, params(6)) == hf_greedy(tiny, [longer], 6)[0]
    decode.wait_metric("tandem:prefix_cache_hits_total", before + 64, tier="store")


class Router:
    """`tandem router` over the cluster's static instances, reading the store index."""

    def __init__(self, tiny: str, tmp, redis_url: str, cluster, min_uncached: int) -> None:
        from services_harness import Proc

        from tandem.launch import http_ok

        a, b, decode = cluster
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.grpc_address = f"127.0.0.1:{free_port()}"
        self.proc = Proc(
            ["router", "--host", "127.0.0.1", "--port", port,
             "--grpc-port", self.grpc_address.rsplit(":", 1)[1],
             "--model", tiny, "--prefill", f"{a.svc.address},{b.svc.address}",
             "--decode", decode.svc.address, "--kv-index-url", redis_url,
             "--disagg-min-uncached-tokens", str(min_uncached)],
            tmp / f"router-{port}.log", ready=lambda: http_ok(f"{self.url}/health"))
        self.proc.wait_ready(120)

    def complete(self, prompt: list[int], max_tokens: int = 6) -> dict:
        import httpx

        resp = httpx.post(f"{self.url}/v1/completions", timeout=120, json={
            "model": httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"],
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        """Greedy token ids of ``prompt`` through the router's gRPC API, and its cached
        prompt tokens."""
        import grpc

        from tandem.v1 import generation_pb2, generation_pb2_grpc

        with grpc.insecure_channel(self.grpc_address) as ch:
            msgs = list(generation_pb2_grpc.GenerationServiceStub(ch).Generate(
                generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt),
                    sampling_params=params(max_tokens, ignore_eos=True)), timeout=120))
        return [t for m in msgs for t in m.token_ids], msgs[-1].usage.cached_tokens

    def metric(self, name: str, **labels: str) -> float:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and labels.items() <= s.labels.items():
                    return s.value
        return 0.0


@pytest.fixture(scope="module")
def routers(tiny, redis_url, cluster, tmp_path_factory):
    """(always disaggregated, conditional with 32 tokens)."""
    tmp = tmp_path_factory.mktemp("routers")
    started = []
    try:
        for threshold in (0, 32):
            started.append(Router(tiny, tmp, redis_url, cluster, threshold))
        yield started
    finally:
        for r in started:
            r.proc.stop()


def test_conditional_disaggregation(tiny, redis_url, tmp_path, cluster, routers):
    always, conditional = routers
    _, _, decode = cluster
    rng = random.Random(22)
    short, long = random_prompt(rng, 10), random_prompt(rng, 100)

    # Short: straight to the decode instance, which prefills it; same text as through
    # the prefill hop.
    got = conditional.complete(short)
    t = got["timings"]
    assert t["disagg_decision"] == "local_prefill", t
    assert t["prefill_instance"] == t["decode_instance"] == decode.svc.address
    want = always.complete(short)
    assert want["timings"]["disagg_decision"] == "remote_prefill"
    assert want["timings"]["prefill_instance"] != decode.svc.address
    assert got["choices"][0]["text"] == want["choices"][0]["text"]

    # Long and new: through a prefill instance.
    got = conditional.complete(long)
    assert got["timings"]["disagg_decision"] == "remote_prefill", got["timings"]
    assert got["timings"]["prefill_instance"] != decode.svc.address
    assert got["choices"][0]["text"] == always.complete(long)["choices"][0]["text"]
    # Long again: 96 of its 100 tokens are cached (decode instance and store): local.
    again = conditional.complete(long)
    assert again["timings"]["disagg_decision"] == "local_prefill", again["timings"]
    assert "4 uncached tokens < 32" in again["timings"]["disagg_reason"]
    assert again["choices"][0]["text"] == got["choices"][0]["text"]

    # A second router replica that never saw this prompt reads the same store index (in
    # Redis), so it decides alike.
    twin = Router(tiny, tmp_path, redis_url, cluster, 32)
    try:
        twin_again = twin.complete(long)
    finally:
        twin.proc.stop()
    assert twin_again["timings"]["disagg_decision"] == "local_prefill", twin_again["timings"]
    assert "4 uncached tokens < 32" in twin_again["timings"]["disagg_reason"]
    assert twin_again["choices"][0]["text"] == got["choices"][0]["text"]

    assert conditional.metric("tandem:router_disagg_decision_total", path="local_prefill") == 2
    assert conditional.metric("tandem:router_disagg_decision_total", path="remote_prefill") == 1
    # One store lookup per request, on both routers (the kv_aware prefill choice reads it).
    assert conditional.metric("tandem:router_kv_store_lookup_seconds_count") == 3
    assert always.metric("tandem:router_kv_store_lookup_seconds_count") == 2


def test_a_next_turn_right_after_the_answer_gets_the_answers_blocks(tiny, cluster, routers):
    """Turn 2 sent the moment turn 1's stream ends: the decode instance may still be
    publishing turn 1's answer. The router, which saw turn 1 finish, tells the prefill
    instance so (``kv_publish_in_flight``), and its store lookup waits for those blocks
    rather than recomputing them: turn 2 always finds turn 1's prompt and answer."""
    from tandem.v1 import common_pb2

    always, _ = routers
    a, b, decode = cluster
    load = {svc: svc.prefill.GetLoad(common_pb2.GetLoadRequest(), timeout=30) if svc is not
            decode.svc else svc.decode.GetLoad(common_pb2.GetLoadRequest(), timeout=30)
            for svc in (a.svc, decode.svc)}
    assert load[decode.svc].kv_publish_output and not load[a.svc].kv_publish_output
    rng = random.Random(23)
    turn1 = random_prompt(rng, 40)
    got1, _ = always.generate(turn1, 30)
    assert got1 == hf_greedy(tiny, [turn1], max_new_tokens=30)[0]
    hints = always.metric("tandem:router_kv_publish_hints_total")
    turn2 = turn1 + got1 + random_prompt(rng, 20)
    got2, cached = always.generate(turn2, 8)
    assert got2 == hf_greedy(tiny, [turn2], max_new_tokens=8)[0]
    assert always.metric("tandem:router_kv_publish_hints_total") == hints + 1
    # KV exists for turn 1's prompt and all but its last generated token: 4 full blocks.
    assert cached == (len(turn1) + len(got1) - 1) // BS * BS == 64


def test_bench_multi_turn_workload_reports_reuse_per_turn(tiny, routers):
    """`tandem bench serve --dataset-name multi-turn`'s workload, small: every turn
    completes, and from turn 2 on at least the previous turn's prompt is cached.

    NOTE: the random model's answers are random token ids; their text does not re-tokenise
    to the same ids in the next turn's chat template, so the answer's blocks are not
    matched here (test_turn_2_on_another_prefill_loads_turn_1_prompt_and_answer covers
    them with token ids)."""
    import asyncio

    import httpx

    from tandem.bench.multiturn import (
        MultiTurnShape,
        build_conversations,
        run_conversations,
        turn_metrics,
    )
    from tandem.engine.model_files import load_tokenizer

    always, _ = routers
    shape = MultiTurnShape(num_conversations=2, num_turns=3, system_len=40, user_len=12,
                           answer_len=8)
    system, users = build_conversations(shape, load_tokenizer(tiny), seed=0)
    model = httpx.get(f"{always.url}/v1/models").json()["data"][0]["id"]
    results, duration = asyncio.run(run_conversations(
        f"{always.url}/v1/chat/completions", model, shape, system, users,
        request_rate=float("inf"), burstiness=1.0, max_concurrency=None, seed=0))
    m = turn_metrics(results, duration, [50, 90])
    assert (m["completed"], m["failed"]) == (6, 0), m["errors"]
    rows = {r["turn"]: r for r in m["per_turn"]}
    assert sorted(rows) == [1, 2, 3]
    assert all(rows[t]["completed"] == 2 and rows[t]["median_ttft_ms"] > 0 for t in rows)
    by_turn = {(r.conversation, r.turn): r for r in results}
    for (c, t), r in by_turn.items():
        if t > 1:
            assert r.cached_tokens >= by_turn[c, t - 1].prompt_tokens // 16 * 16, (c, t)


def test_bench_mixed_runs_short_streams_beside_long_prompts(tiny, routers):
    """`tandem bench mixed`'s load, small: every short stream completes with its tokens
    while long prompts are sent one after another, and the long ones still open at the
    end are cancelled, not counted."""
    import asyncio

    import httpx

    from tandem.bench.mixed import run_mixed
    from tandem.bench.serve import sample_prompts
    from tandem.engine.model_files import load_tokenizer

    always, _ = routers
    vocab = len(load_tokenizer(tiny))
    short = sample_prompts(4, 8, 6, 0.0, vocab, seed=1)
    long = sample_prompts(2, 100, 2, 0.0, vocab, seed=2)
    model = httpx.get(f"{always.url}/v1/models").json()["data"][0]["id"]
    results, long_done, duration = asyncio.run(run_mixed(
        f"{always.url}/v1/completions", model, short, long, short_concurrency=2,
        long_concurrency=1))
    assert [(r.success, r.output_tokens) for r in results] == [(True, 6)] * 4, \
        [r.error for r in results]
    assert all(r.success and r.output_tokens == 2 and r.prompt_len == 100 for r in long_done)
    assert duration > 0
    with pytest.raises(ValueError, match="long"):
        asyncio.run(run_mixed(f"{always.url}/v1/completions", model, short, [], 2, 1))
