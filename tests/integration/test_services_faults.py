"""Faults in disaggregated serving, caused for real: a store node killed before the pull,
a decode process killed mid-stream. Tiny random Llama, float32."""

from __future__ import annotations

import grpc
import pytest
from services_harness import (
    EngineService,
    KVStoreNode,
    decode_request_from,
    hf_greedy,
    params,
    tiny_model_dir,
)

from tandem.v1 import decode_pb2, prefill_pb2

ARGS = ["--num-kv-blocks", "128", "--block-size", "16"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(tiny_model_dir(tmp_path_factory.getbasetemp()))


def test_store_node_killed_before_pull_decode_recomputes(tiny, redis_url, tmp_path):
    store = KVStoreNode(redis_url, tmp_path)
    prefill = decode = None
    try:
        prefill = EngineService("prefill", tiny, tmp_path, redis_url, ARGS)
        decode = EngineService("decode", tiny, tmp_path, redis_url, ARGS)
        prompt = list(range(700, 790))
        sp = params(8)
        pre = prefill.prefill.Prefill(
            prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp), timeout=60)
        assert pre.publish_ns > 0
        store.proc.kill()  # the only node holding the blocks is gone
        failures_before = decode.get_load().num_kv_load_failures
        msgs = list(decode.decode.Decode(decode_request_from(pre, prompt, sp), timeout=120))
        tokens = [pre.first_token_id] + [t for m in msgs for t in m.token_ids]
        assert tokens == hf_greedy(tiny, [prompt], 8)[0], "recomputed output must be unchanged"
        assert msgs[0].num_cached_tokens < len(prompt), "the prompt was recomputed, not loaded"
        assert decode.get_load().num_kv_load_failures == failures_before + 1
    finally:
        for svc in (decode, prefill):
            if svc is not None:
                svc.stop()
        store.stop()


def test_decode_killed_mid_stream_gives_unavailable_promptly(tiny, redis_url, tmp_path):
    decode = EngineService("decode", tiny, tmp_path, redis_url, ARGS)
    try:
        call = decode.decode.Decode(decode_pb2.DecodeRequest(
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
