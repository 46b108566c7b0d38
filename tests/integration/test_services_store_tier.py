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
    EngineService,
    hf_greedy,
    metric_value,
    params,
    run_disaggregated,
    wait_for,
)

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]
BS = 16


class Instance:
    """An EngineService with a /metrics port."""

    def __init__(self, role: str, tiny: str, tmp, redis_url: str, *extra: str) -> None:
        self.metrics_port = free_port()
        self.svc = EngineService(role, tiny, tmp, redis_url,
                                 [*ENGINE_ARGS, "--metrics-port", str(self.metrics_port), *extra])

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics_port, name, **labels)

    def wait_metric(self, name: str, value: float, **labels: str) -> None:
        """Until the metric reads ``value`` (counters follow the engine about once a second)."""
        wait_for(lambda: self.metric(name, **labels) == value, 30,
                 f"{name}{labels} == {value} (is {self.metric(name, **labels)})")


@pytest.fixture(scope="module")
def cluster(tiny, redis_url, store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tier")
    started: list[Instance] = []
    try:
        for role in ("prefill", "prefill", "decode"):
            started.append(Instance(role, tiny, tmp, redis_url))
        yield started
    finally:
        for inst in started:
            inst.svc.stop()


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_prefill_b_loads_what_prefill_a_computed(tiny, cluster):
    a, b, decode = cluster
    rng = random.Random(19)
    prompt = _prompt(rng, 100)  # 6 full blocks and a partial one
    longer = prompt + _prompt(rng, 45)
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
    turn1 = _prompt(rng, 40)
    want1 = hf_greedy(tiny, [turn1], max_new_tokens=30)[0]
    published = decode.metric("tandem:kv_output_publishes_total", outcome="ok")
    got1, _ = run_disaggregated(a.svc, decode.svc, turn1, params(30))
    assert got1 == want1 and len(got1) == 30
    # The decode publishes after its stream ended: wait for it, not for a time.
    decode.wait_metric("tandem:kv_output_publishes_total", published + 1, outcome="ok")

    turn2 = turn1 + got1 + _prompt(rng, 20)
    want2 = hf_greedy(tiny, [turn2], max_new_tokens=8)[0]
    store_before = b.metric("tandem:prefix_cache_hits_total", tier="store")
    got2, pre = run_disaggregated(b.svc, decode.svc, turn2, params(8))
    assert got2 == want2
    # KV exists for turn 1's prompt and all but the last generated token: 69 tokens,
    # 4 full blocks, all from the store (B never saw turn 1).
    assert pre.num_cached_tokens == (len(turn1) + len(got1) - 1) // BS * BS == 64
    b.wait_metric("tandem:prefix_cache_hits_total", store_before + 64, tier="store")
