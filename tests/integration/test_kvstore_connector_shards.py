"""The store connector with a tensor/pipeline-parallel engine's sharded KV cache, over a
real store node: blocks go to the store in the full model's layout, so a TP=2 prefill's
blocks load into a TP=1 decode and the reverse (issue 18's mixed-TP disaggregation).

The per-rank caches are cut from a reference full cache (tests/kv_shard_cases.py); the
connectors are the real ones (transfer threads, KVStoreClient), in this process.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import pytest
import torch
from kv_shard_cases import assert_shards_hold, split
from kvstore_harness import StoreNodeProcess
from transfer_recorder import Recorder
from waiting import wait_until

from tandem.contracts.block_hash import prompt_block_hashes
from tandem.contracts.block_key import KVTransferParams
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.kv_connector import LoadResult
from tandem.engine.kv_shards import ShardedKVCache
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import SchedulerOutput
from tandem.kvstore.client import KVStoreClient
from tandem.kvstore.connector import build_store_connector

pytest.importorskip("ucxx")

BS, NUM_BLOCKS = 4, 8
SRC_BLOCKS = [2, 3, 6]  # a run and a lone block: both staging paths
DST_BLOCKS = [5, 1, 0]


@pytest.fixture(scope="module")
def store_url(redis_url: str) -> str:
    # NOTE: a database of its own: other modules' nodes and keys stay invisible.
    return redis_url.rsplit("/", 1)[0] + "/5"


@pytest.fixture(scope="module")
def node(store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreNodeProcess]:
    proc = StoreNodeProcess(store_url, "shards", 4 << 20,
                            log_dir=tmp_path_factory.mktemp("kvstore"))
    client = KVStoreClient(store_url, timeout_s=10)
    try:
        proc.wait_ready(client)
        yield proc
    finally:
        client.close()
        proc.stop()


def transfer(store_url: str, node: StoreNodeProcess, layout: KVCacheLayout,
             src: torch.Tensor | ShardedKVCache, dst: torch.Tensor | ShardedKVCache,
             prompt: list[int]) -> LoadResult:
    """Publish ``prompt``'s blocks ``SRC_BLOCKS`` of ``src`` as a prefill does, then load
    them into ``DST_BLOCKS`` of ``dst`` as a decode does; the load's outcome."""
    events = Recorder()

    def connect() -> KVStoreClient:
        return KVStoreClient(store_url, layout=layout, local_node=node.address, timeout_s=10)

    producer, p_worker = build_store_connector("kv_producer", layout, connect, 1)
    p_worker.set_listener(events)
    try:
        p_worker.register_kv_caches(src)
        req = Request("p", prompt, SamplingParams(max_tokens=1))
        req.num_computed_tokens = len(prompt)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert producer.request_finished(req, SRC_BLOCKS)
        wait_until(lambda: "p" in events.saves, 30, "the save")
        assert events.saves["p"].ok, events.saves["p"].error
        assert events.saves["p"].num_stored == len(SRC_BLOCKS)
    finally:
        p_worker.shutdown()

    consumer, c_worker = build_store_connector("kv_consumer", layout, connect, 1)
    c_worker.set_listener(events)
    try:
        c_worker.register_kv_caches(dst)
        req = Request("d", prompt, SamplingParams(max_tokens=4))
        req.kv_transfer_params = KVTransferParams(
            tuple(prompt_block_hashes(prompt, BS)), layout.fingerprint)
        assert consumer.get_num_new_matched_tokens(req, 0) == len(prompt)
        consumer.update_state_after_alloc(req, DST_BLOCKS, len(prompt))
        c_worker.start_load_kv(consumer.build_connector_meta(SchedulerOutput()))
        wait_until(lambda: "d" in events.loads, 30, "the load")
        assert c_worker.get_finished() == (set(), {"d": len(prompt)})
    finally:
        c_worker.shutdown()
    return events.loads["d"]


# name: (num_kv_heads, num_layers, head_dim, tp, pp); equal block bytes (a node's slot
# size is fixed by its first block)
CASES = {
    "tp2": (2, 2, 8, 2, 1),
    "tp2-one-kv-head-replicated": (1, 2, 16, 2, 1),
    "tp2xpp2": (2, 4, 4, 2, 2),
}


@pytest.mark.parametrize("direction", ["sharded-to-tp1", "tp1-to-sharded"])
@pytest.mark.parametrize("case", CASES)
def test_blocks_move_between_engines_of_different_tp(
    store_url: str, node: StoreNodeProcess, case: str, direction: str
) -> None:
    n_heads, n_layers, head_dim, tp, pp = CASES[case]
    # The full model's layout: the same fingerprint whatever the TP/PP of each side.
    layout = KVCacheLayout("shards-test", num_layers=n_layers, num_kv_heads=n_heads,
                           head_dim=head_dim, dtype="float32", block_size=BS)
    ref = torch.randn(NUM_BLOCKS, *layout.block_shape)
    # 2 full blocks and a partial one; a prompt per test, so no test finds another's blocks
    base = zlib.crc32(f"{case}/{direction}".encode()) % 10_000
    prompt = [base + i for i in range(2 * BS + 2)]
    expect = torch.zeros_like(ref)
    expect[DST_BLOCKS] = ref[SRC_BLOCKS]

    if direction == "sharded-to-tp1":
        dst = torch.zeros_like(ref)
        result = transfer(store_url, node, layout, split(ref, tp, pp), dst, prompt)
        assert torch.equal(dst, expect)
    else:
        sharded = split(torch.zeros_like(ref), tp, pp)
        result = transfer(store_url, node, layout, ref, sharded, prompt)
        assert_shards_hold(sharded, expect)  # replicas included; other blocks untouched
    assert result.complete and result.num_bytes == len(SRC_BLOCKS) * layout.block_bytes
