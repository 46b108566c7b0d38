"""The store node's disk tier under real services: a prompt's blocks published by one
prefill instance are pushed out of the store's RAM (a few blocks) to its disk tier by
other prompts; another prefill instance then loads them (read back from disk) and the
tokens equal transformers' ``generate(do_sample=False)`` (tiny random Llama, float32).
"""

from __future__ import annotations

import random

import pytest
from services_harness import (
    KVStoreNode,
    hf_greedy,
    metered_engines,
    metric_value,
    params,
    random_prompt,
    run_disaggregated,
)

ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]
#: the tiny model's KV block: 2 layers x K and V x 2 heads x 16 dims x 16 tokens x 4 bytes
BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4
RAM_BLOCKS = 8


@pytest.fixture(scope="module")
def store(redis_url, tmp_path_factory):
    """A store node whose RAM holds 8 blocks, with a disk tier."""
    tmp = tmp_path_factory.mktemp("disk-store")
    node = KVStoreNode(
        redis_url,
        tmp,
        capacity_bytes=RAM_BLOCKS * BLOCK_BYTES,
        extra_args=("--disk-path", str(tmp / "disk"), "--disk-capacity", "64M"),
    )
    yield node
    node.stop()


@pytest.fixture(scope="module")
def cluster(tiny, redis_url, store, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk-tier")
    with metered_engines(("prefill", "prefill", "decode"), tiny, tmp, redis_url,
                         ENGINE_ARGS) as started:
        yield started


def test_blocks_read_back_from_the_disk_tier_give_equal_tokens(tiny, store, cluster):
    a, b, decode = cluster
    rng = random.Random(41)
    prompt = random_prompt(rng, 100)  # 6 full blocks and a partial one
    longer = prompt + random_prompt(rng, 45)
    fillers = [random_prompt(rng, 100) for _ in range(3)]
    want, want_longer = hf_greedy(tiny, [prompt, longer], max_new_tokens=8)

    got, pre = run_disaggregated(a.svc, decode.svc, prompt, params(8))
    assert got == want
    # other prompts' blocks push the prompt's out of the store's RAM, to its disk
    for filler in fillers:
        run_disaggregated(a.svc, decode.svc, filler, params(2))
    assert metric_value(store.metrics_port, "tandem:kvstore_tier_blocks", tier="disk") >= 6

    disk_hits = metric_value(store.metrics_port, "tandem:kvstore_tier_hits_total", tier="disk")
    # B has never seen the prefix: it loads A's 6 full blocks, read back from disk
    got, pre = run_disaggregated(b.svc, decode.svc, longer, params(8))
    assert got == want_longer
    assert pre.num_cached_tokens == 96
    b.wait_metric("tandem:prefix_cache_hits_total", 96, tier="store")
    after = metric_value(store.metrics_port, "tandem:kvstore_tier_hits_total", tier="disk")
    assert after - disk_hits >= 6
