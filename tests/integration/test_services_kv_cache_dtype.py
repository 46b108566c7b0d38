"""``--kv-cache-dtype fp8`` across the store, over real services (real Redis, a store
node, gRPC): an FP8 prefill feeds an FP8 decode at a quarter of the float32 bytes per
token and gives the colocated FP8 tokens; an ``auto`` decode never loads the FP8 blocks
(its store lookups are counted, none hits, it recomputes) and gives transformers' tokens.
Tiny random Llama in float32."""

from __future__ import annotations

import random

import pytest
from services_harness import (
    MeteredEngine,
    hf_greedy,
    params,
    random_prompt,
    run_colocated,
    run_disaggregated,
    wait_published,
)

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]
FP8 = ["--kv-cache-dtype", "fp8"]


@pytest.fixture(scope="module")
def engines(tiny, redis_url, store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvdtype")
    started: dict[str, MeteredEngine] = {}
    try:
        for name, role, extra in (("prefill_fp8", "prefill", FP8),
                                  ("decode_fp8", "decode", FP8),
                                  ("decode_auto", "decode", []),
                                  ("colocated_fp8", "decode", FP8)):
            started[name] = MeteredEngine(role, tiny, tmp, redis_url, [*ENGINE_ARGS, *extra])
        yield started
    finally:
        for inst in started.values():
            inst.svc.stop()


def test_fp8_prefill_feeds_fp8_decode_and_never_an_auto_one(tiny, redis_url, engines):
    prefill, fp8, auto = engines["prefill_fp8"], engines["decode_fp8"], engines["decode_auto"]
    per_token = {n: e.metric("tandem:kv_cache_bytes_per_token") for n, e in engines.items()}
    assert per_token["prefill_fp8"] == per_token["decode_fp8"] > 0
    assert per_token["decode_auto"] == 4 * per_token["decode_fp8"]  # float32 vs one byte
    tokens = {n: e.metric("tandem:kv_cache_capacity_tokens") for n, e in engines.items()}
    assert tokens["decode_fp8"] == tokens["decode_auto"] == 256 * 16  # --num-kv-blocks
    assert prefill.metric("tandem:model_weight_bytes") == auto.metric(
        "tandem:model_weight_bytes") > 0

    rng = random.Random(7)
    prompt = random_prompt(rng, 70)  # 4 full blocks and a partial one, all loaded
    got, pre = run_disaggregated(prefill.svc, fp8.svc, prompt, params(8))
    wait_published(redis_url, pre)
    fp8.wait_metric("tandem:prefix_cache_hits_total", len(prompt), tier="store")
    assert got == run_colocated(engines["colocated_fp8"].svc, prompt, params(8))

    queries = auto.metric("tandem:prefix_cache_queries_total", tier="store")
    other = random_prompt(rng, 70)
    got, pre = run_disaggregated(prefill.svc, auto.svc, other, params(8))
    wait_published(redis_url, pre)
    # token 1 is the FP8 prefill's; the auto decode recomputed the prompt in float32,
    # so the rest is transformers' continuation of prompt + token 1
    assert got[1:] == hf_greedy(tiny, [other + got[:1]], max_new_tokens=7)[0]
    assert auto.metric("tandem:prefix_cache_queries_total", tier="store") > queries
    assert auto.metric("tandem:prefix_cache_hits_total", tier="store") == 0
