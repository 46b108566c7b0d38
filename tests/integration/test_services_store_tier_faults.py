"""Faults on the store tier's load path, caused for real: a prefill instance loading a
prefix another one computed finds a corrupt block, an index entry naming a node that is
gone, a store too small to keep everything, and finally the store node killed. Output
stays transformers' greedy output (the engine recomputes what it could not load) and
the counters say what happened. Tiny random Llama, float32.

NOTE: the tests run in file order on purpose: the last one kills the module's store node.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvstore_harness import corrupt_block
from services_harness import (
    KVStoreNode,
    MeteredEngine,
    hf_greedy,
    metered_engines,
    metric_value,
    params,
    random_prompt,
    run_disaggregated,
    wait_for,
    wait_published,
)

from tandem.contracts.block_hash import prompt_block_hashes
from tandem.contracts.block_key import BlockKey
from tandem.v1 import prefill_pb2

ENGINE_ARGS = ["--num-kv-blocks", "128", "--block-size", "16"]
BS = 16
#: Store capacity in blocks: enough for one test's prompts, too few for all of them.
STORE_BLOCKS = 24


def _block_bytes(tiny: str) -> int:
    cfg = json.loads((Path(tiny) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BS * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def store(tiny, redis_url, tmp_path_factory):
    node = KVStoreNode(redis_url, tmp_path_factory.mktemp("store"),
                       capacity_bytes=STORE_BLOCKS * _block_bytes(tiny))
    yield node
    node.stop()


@pytest.fixture(scope="module")
def cluster(tiny, redis_url, store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tier-faults")
    with metered_engines(("prefill", "prefill", "decode"), tiny, tmp, redis_url,
                         ENGINE_ARGS) as started:
        yield started


def _prefill(inst: MeteredEngine, prompt: list[int], redis_url: str
             ) -> prefill_pb2.PrefillResponse:
    """Prefill ``prompt`` on ``inst`` and wait until its blocks are in the store."""
    pre = inst.svc.prefill.Prefill(prefill_pb2.PrefillRequest(
        prompt_token_ids=prompt, sampling_params=params(1)), timeout=120)
    wait_published(redis_url, pre)
    return pre


def _store_metric(store: KVStoreNode, name: str) -> float:
    return metric_value(store.metrics_port, name)


def test_a_corrupt_block_ends_the_load_and_the_rest_is_computed(tiny, redis_url, store,
                                                                cluster):
    from tandem.kvstore.client import KVStoreClient

    a, b, decode = cluster
    prompt = random_prompt(1, 80)  # 5 full blocks; B may load 4 (the last token is computed)
    pre = _prefill(a, prompt, redis_url)
    with KVStoreClient(redis_url) as client:
        corrupt_block(client, redis_url, BlockKey(pre.block_hashes[2], pre.kv_layout_fingerprint))
    got, pre_b = run_disaggregated(b.svc, decode.svc, prompt, params(8))
    assert got == hf_greedy(tiny, [prompt], 8)[0], "bad bytes must never reach the output"
    assert pre_b.num_cached_tokens == 32, "blocks 0-1 loaded, block 2 on computed"
    b.wait_metric("tandem:kv_load_failures_total", 1)
    b.wait_metric("tandem:prefix_cache_hits_total", 32, tier="store")


def test_an_index_entry_of_a_gone_node_is_a_miss(tiny, redis_url, cluster):
    import redis

    from tandem.kvstore.index import IndexEntry

    a, b, decode = cluster
    prompt = random_prompt(2, 60)
    pre = _prefill(a, prompt, redis_url)
    key = BlockKey(pre.block_hashes[0], pre.kv_layout_fingerprint)
    r = redis.Redis.from_url(redis_url)
    try:
        entry = IndexEntry.decode(r.get(key.redis_key))
        assert entry is not None
        # The entry now names a node whose registry key is gone (it died long ago).
        r.set(key.redis_key, IndexEntry("gone-node", entry.slot, entry.size_bytes,
                                        entry.checksum).encode())
    finally:
        r.close()
    queries, hits, failures = (b.metric("tandem:prefix_cache_queries_total", tier="store"),
                               b.metric("tandem:prefix_cache_hits_total", tier="store"),
                               b.metric("tandem:kv_load_failures_total"))
    got, pre_b = run_disaggregated(b.svc, decode.svc, prompt, params(8))
    assert got == hf_greedy(tiny, [prompt], 8)[0]
    assert pre_b.num_cached_tokens == 0, "block 0 is a miss, so the whole prefix is"
    b.wait_metric("tandem:prefix_cache_queries_total", queries + len(prompt), tier="store")
    assert b.metric("tandem:prefix_cache_hits_total", tier="store") == hits
    assert b.metric("tandem:kv_load_failures_total") == failures, "no load was tried"


def test_a_full_store_evicts_and_an_evicted_prefix_is_computed(tiny, redis_url, store,
                                                                cluster):
    a, b, decode = cluster
    evictions = _store_metric(store, "tandem:kvstore_evictions_total")
    first = random_prompt(3, 160)  # 10 blocks
    _prefill(a, first, redis_url)
    for seed in (4, 5, 6):  # 30 more blocks than the store holds: all of first's go
        _prefill(a, random_prompt(seed, 160), redis_url)
    wait_for(lambda: _store_metric(store, "tandem:kvstore_evictions_total") >= evictions + 10,
             30, "the store evicted blocks")
    queries, hits = (b.metric("tandem:prefix_cache_queries_total", tier="store"),
                     b.metric("tandem:prefix_cache_hits_total", tier="store"))
    got, pre_b = run_disaggregated(b.svc, decode.svc, first, params(8))
    assert got == hf_greedy(tiny, [first], 8)[0]
    assert pre_b.num_cached_tokens == 0, "the evicted prefix is computed"
    b.wait_metric("tandem:prefix_cache_queries_total", queries + len(first), tier="store")
    assert b.metric("tandem:prefix_cache_hits_total", tier="store") == hits

    # A prompt larger than the whole store cannot be published: the prefill still answers
    # (the publish failed), the decode recomputes, the output is unchanged.
    huge = random_prompt(7, (STORE_BLOCKS + 4) * BS)
    got, pre_huge = run_disaggregated(a.svc, decode.svc, huge, params(4))
    assert got == hf_greedy(tiny, [huge], 4)[0]
    assert len(pre_huge.block_hashes) == len(prompt_block_hashes(huge, BS))


def test_the_store_node_killed_loads_miss_and_nothing_hangs(tiny, redis_url, store, cluster):
    a, b, decode = cluster
    prompt = random_prompt(8, 70)
    _prefill(a, prompt, redis_url)
    store.proc.kill()
    failures = b.metric("tandem:kv_load_failures_total")
    got, pre_b = run_disaggregated(b.svc, decode.svc, prompt, params(8))
    assert got == hf_greedy(tiny, [prompt], 8)[0], "recomputed output must be unchanged"
    assert pre_b.num_cached_tokens == 0
    # The index still named the node (its heartbeat had not expired): B tried and missed.
    b.wait_metric("tandem:kv_load_failures_total", failures + 1)
