"""Faults in disaggregated serving, caused for real: a corrupt block in the store, the
store node killed before the pull, a decode process killed mid-stream. Tiny random Llama,
float32, oracle transformers ``generate(do_sample=False)``.

NOTE: the tests run in file order on purpose: the store-kill test ends the module's
store node, so it comes after the test that needs that node alive.
"""

from __future__ import annotations

import grpc
import pytest
from kvstore_harness import corrupt_block
from services_harness import (
    EngineService,
    decode_request_from,
    hf_greedy,
    params,
    wait_published,
)

from tandem.services.decode.client import DecodeCall
from tandem.v1 import decode_pb2, prefill_pb2

#: Flags of the module's prefill and decode services (conftest's fixtures read it).
ENGINE_ARGS = ["--num-kv-blocks", "128", "--block-size", "16"]


def _decode_after_one_failed_load(tiny, decode, pre, prompt, sp, failures_before: int,
                                  why: str) -> int:
    """Decode the request that ``pre`` prefilled: its tokens must equal transformers' (else
    fail with ``why``) and the service must count one more failed KV load than
    ``failures_before``. Returns the first message's ``num_cached_tokens``."""
    msgs = list(DecodeCall(decode.decode, decode_request_from(pre, prompt, sp), timeout=120))
    tokens = [pre.first_token_id] + [t for m in msgs for t in m.token_ids]
    assert tokens == hf_greedy(tiny, [prompt], 8)[0], why
    assert decode.get_load().num_kv_load_failures == failures_before + 1
    return msgs[0].num_cached_tokens


def test_corrupt_block_is_a_miss_and_the_rest_is_recomputed(tiny, redis_url, store, prefill,
                                                            decode):
    from tandem.contracts.block_key import BlockKey
    from tandem.kvstore.client import KVStoreClient

    prompt = list(range(900, 980))  # 5 blocks of 16
    sp = params(8)
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp), timeout=60)
    wait_published(redis_url, pre)
    with KVStoreClient(redis_url) as client:
        (node_id,) = [n for n, info in client.live_nodes().items()
                      if info.address == store.address]
        key = BlockKey(pre.block_hashes[2], pre.kv_layout_fingerprint)
        corrupt_block(client, redis_url, key)
    failures_before = decode.get_load().num_kv_load_failures
    cached = _decode_after_one_failed_load(tiny, decode, pre, prompt, sp, failures_before,
                                           "bad bytes must never reach the output")
    assert cached == 32, "blocks 0-1 loaded, block 2 on recomputed"


def test_store_node_killed_before_pull_decode_recomputes(tiny, redis_url, store, prefill,
                                                         decode):
    prompt = list(range(700, 790))
    sp = params(8)
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp), timeout=60)
    wait_published(redis_url, pre)
    store.proc.kill()  # the only node holding the blocks is gone
    failures_before = decode.get_load().num_kv_load_failures
    cached = _decode_after_one_failed_load(tiny, decode, pre, prompt, sp, failures_before,
                                           "recomputed output must be unchanged")
    assert cached == 0, "the prompt was recomputed, not loaded"


def test_decode_killed_mid_stream_gives_unavailable_promptly(tiny, redis_url, tmp_path):
    decode = EngineService("decode", tiny, tmp_path, redis_url, ENGINE_ARGS)
    try:
        call = DecodeCall(decode.decode, decode_pb2.DecodeRequest(
            prompt_token_ids=[5, 6, 7, 8], sampling_params=params(5000, ignore_eos=True)),
            timeout=300)
        next(call)
        decode.proc.kill()
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        # UNAVAILABLE, not DEADLINE_EXCEEDED: the broken connection ends the stream at once.
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    finally:
        decode.stop()
