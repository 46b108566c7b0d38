"""Prefill -> KV store -> decode over real gRPC services, a real UCX store and real Redis.

Tiny random-weight Llama (float32). The oracle is transformers
``generate(do_sample=False)``. The services run with a 64-token step budget, so
prompts longer than 64 tokens are prefilled in chunks on both sides.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import grpc
import pytest
from services_harness import (
    decode_request_from,
    hf_greedy,
    params,
    random_prompt,
    run_colocated,
    run_disaggregated,
    wait_for,
)

from tandem.services.decode.client import DecodeCall
from tandem.services.router.decode_mux import DecodeMux
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

#: Flags of the module's prefill and decode services (conftest's fixtures read it).
ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]


@pytest.fixture(scope="module")
def colocated(decode):
    """The colocated form (Decode without a first token) on the decode instance: the same
    code path as `--role both` (tested on its own in test_services_colocated.py)."""
    return decode


def test_greedy_disaggregated_and_colocated_match_transformers(tiny, prefill, decode, colocated):
    rng = random.Random(0)
    # Lengths: below one block, exactly one block, partial last block, chunked (> 64).
    prompts = [random_prompt(rng, n) for n in (5, 16, 37, 100, 150)]
    expected = hf_greedy(tiny, prompts, max_new_tokens=12)
    for prompt, want in zip(prompts, expected, strict=True):
        got, pre = run_disaggregated(prefill, decode, prompt, params(12))
        assert got == want, f"disaggregated, prompt of {len(prompt)} tokens"
        assert len(pre.block_hashes) == -(-len(prompt) // 16)
        assert pre.num_prompt_tokens == len(prompt)
        assert run_colocated(colocated, prompt, params(12)) == want, "colocated"


def test_prefix_already_in_store_and_cached_locally(tiny, prefill, decode):
    rng = random.Random(1)
    base = random_prompt(rng, 80)
    first = base + random_prompt(rng, 7)
    second = base[:64] + random_prompt(rng, 30)  # shares 4 full blocks with `first`
    want = hf_greedy(tiny, [first, second], max_new_tokens=10)
    got1, _ = run_disaggregated(prefill, decode, first, params(10))
    got2, pre2 = run_disaggregated(prefill, decode, second, params(10))
    assert [got1, got2] == want
    assert pre2.num_cached_tokens == 64, "prefill's prefix cache should serve the shared blocks"
    # The same prompt again: the decode side's own prefix cache serves part of it.
    again, _ = run_disaggregated(prefill, decode, second, params(10))
    assert again == want[1]


def test_max_tokens_one_finishes_at_prefill(prefill):
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=[5, 6, 7], sampling_params=params(1)),
        timeout=60,
    )
    assert pre.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_logprobs_from_prefill_and_decode(tiny, prefill, decode):
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    sp = params(4, logprobs=3)
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp), timeout=60)
    assert pre.first_logprobs.sampled.token_id == pre.first_token_id
    assert len(pre.first_logprobs.top) == 3
    assert pre.first_logprobs.top[0].token_id == pre.first_token_id  # greedy = rank 1
    msgs = list(DecodeCall(decode.decode, decode_request_from(pre, prompt, sp), timeout=60))
    lps = [lp for m in msgs for lp in m.logprobs]
    toks = [t for m in msgs for t in m.token_ids]
    assert [lp.sampled.token_id for lp in lps] == toks
    assert all(len(lp.top) == 3 and lp.sampled.logprob <= 0 for lp in lps)


def test_32_concurrent_requests_of_mixed_lengths(tiny, prefill, decode):
    rng = random.Random(2)
    prompts = [random_prompt(rng, rng.randrange(1, 200)) for _ in range(32)]
    max_tokens = [rng.randrange(1, 12) for _ in range(32)]
    oracle = hf_greedy(tiny, prompts, max_new_tokens=12)

    async def one(pstub, mux: DecodeMux, i: int) -> list[int]:
        sp = params(max_tokens[i])
        pre = await pstub.Prefill(prefill_pb2.PrefillRequest(
            request_id=f"c{i}", prompt_token_ids=prompts[i], sampling_params=sp), timeout=300)
        toks = [pre.first_token_id]
        if pre.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            async for msg in mux.start(decode_request_from(pre, prompts[i], sp)):
                toks.extend(msg.token_ids)
        return toks

    async def main() -> list[list[int]]:
        async with grpc.aio.insecure_channel(prefill.address) as pch, \
                grpc.aio.insecure_channel(decode.address) as dch:
            pstub = prefill_pb2_grpc.PrefillServiceStub(pch)
            # the router's form: every request a stream of one DecodeStream call
            mux = DecodeMux(decode.address, decode_pb2_grpc.DecodeServiceStub(dch),
                            lambda _mux, _error: None)
            try:
                return await asyncio.gather(*(one(pstub, mux, i) for i in range(32)))
            finally:
                await mux.close()

    results = asyncio.run(main())
    for i, got in enumerate(results):
        assert got == oracle[i][: max_tokens[i]], f"request {i} ({len(prompts[i])} tokens)"


def test_seeded_sampling_same_text_disaggregated_and_colocated(prefill, decode, colocated):
    prompt = list(range(200, 260))
    sp = params(16, temperature=0.9, top_k=50, seed=1234)
    disagg, _ = run_disaggregated(prefill, decode, prompt, sp)
    assert disagg == run_colocated(colocated, prompt, sp)
    other = run_colocated(colocated, prompt, params(16, temperature=0.9, top_k=50, seed=99))
    assert other != disagg, "a different seed should sample differently"


def test_cancelling_a_stream_frees_its_blocks(prefill, decode):
    prompt = list(range(300, 400))
    sp = params(400, ignore_eos=True)
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=sp), timeout=60)
    total = decode.get_load().num_total_blocks
    call = DecodeCall(decode.decode, decode_request_from(pre, prompt, sp), timeout=120)
    next(call)
    next(call)
    assert decode.get_load().num_running_requests == 1
    call.cancel()
    wait_for(lambda: decode.get_load().num_free_blocks == total, 30, "decode pool back to full")
    assert decode.get_load().num_running_requests == 0
    wait_for(lambda: prefill.get_load().num_free_blocks == prefill.get_load().num_total_blocks,
             30, "prefill pool back to full (it keeps only its prefix cache)")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.ClearField("prompt_token_ids"), "prompt_token_ids"),
        (lambda r: r.prompt_token_ids.append(10**6), "prompt_token_ids"),
        (lambda r: r.sampling_params.MergeFrom(common_pb2.SamplingParams(temperature=-1)),
         "temperature"),
        (lambda r: r.sampling_params.MergeFrom(common_pb2.SamplingParams(top_p=0.0)), "top_p"),
        (lambda r: r.sampling_params.logit_bias.__setitem__(7, 500.0), "logit_bias"),
        (lambda r: r.block_hashes.append(b"x" * 32), "block_hashes"),
        (lambda r: setattr(r, "first_token_id", -3), "first_token_id"),
        (lambda r: r.output_token_ids.append(9), "output_token_ids"),
        # Bugs (H9): a block hash of the wrong length was taken (and silently recomputed);
        # a NaN temperature was accepted and sampled garbage.
        (lambda r: r.block_hashes.__setitem__(0, b"abc"), "block_hashes"),
        (lambda r: r.sampling_params.MergeFrom(common_pb2.SamplingParams(
            temperature=float("nan"))), "temperature"),
    ],
)
def test_bad_decode_requests_are_invalid_argument(prefill, decode, mutate, field):
    prompt = [21, 22, 23, 24, 25]
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=params(4)),
        timeout=60)
    req = decode_request_from(pre, prompt, params(4))
    mutate(req)
    with pytest.raises(grpc.RpcError) as err:
        list(DecodeCall(decode.decode, req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    # The instance is undisturbed.
    assert run_disaggregated(prefill, decode, prompt, params(4))[0]


def test_bad_prefill_request_and_layout_mismatch(prefill, decode):
    with pytest.raises(grpc.RpcError) as err:
        prefill.prefill.Prefill(prefill_pb2.PrefillRequest(
            prompt_token_ids=[1, 2], sampling_params=params(4, min_p=2.0)), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_p" in err.value.details()
    prompt = [31, 32, 33]
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=params(4)),
        timeout=60)
    # blocks of another layout are never read: a miss, the prompt recomputed, the same
    # tokens as the handoff of this layout's blocks
    want = [pre.first_token_id] + [t for m in DecodeCall(decode.decode,
        decode_request_from(pre, prompt, params(4)), timeout=60) for t in m.token_ids]
    for field, value in (("kv_layout_fingerprint", b"another-layout!!"),
                         ("hash_algorithm", "another-hash")):
        req = decode_request_from(pre, prompt, params(4))
        setattr(req, field, value)
        got = [pre.first_token_id] + [t for m in DecodeCall(decode.decode, req, timeout=60)
                                      for t in m.token_ids]
        assert got == want, field


def test_health_reflection_and_registry(redis_url, prefill, decode):
    import redis
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(decode.channel)
    resp = next(stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in resp.list_services_response.service}
    assert "tandem.v1.DecodeService" in names
    assert "grpc.health.v1.Health" in names

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = set(r.scan_iter("tandem:instance:*"))
    by_address = {r.hget(k, "address"): k for k in keys}
    for svc in (prefill, decode):
        key = by_address[svc.address]
        assert key.startswith(f"tandem:instance:{svc.role}:")
        entry = r.hgetall(key)
        assert entry["role"] == svc.role
        assert entry["model"] == svc.get_load().model
        assert int(entry["num_free_blocks"]) > 0
        assert 0 < r.ttl(key) <= 10


def test_decode_accepts_colocated_form(tiny, decode):
    prompt = [41, 42, 43, 44, 45, 46]
    got = run_colocated(decode, prompt, params(6))
    assert got == hf_greedy(tiny, [prompt], 6)[0]


def test_first_message_reports_kv_pull(tiny, prefill, decode):
    """The first message says how long the KV pull took and how many bytes it moved:
    every block of the prompt (two full, one partial), in the engine's float32 (the
    router's handoff-bytes metric adds these up)."""
    cfg = json.loads((Path(tiny) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4
    prompt = list(range(500, 540))
    pre = prefill.prefill.Prefill(
        prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=params(3)),
        timeout=60)
    first = next(iter(DecodeCall(decode.decode,
        decode_request_from(pre, prompt, params(3)), timeout=60)))
    assert first.HasField("kv_pull_ns") and first.kv_pull_ns > 0
    assert first.num_cached_tokens == len(prompt), "the whole prompt should come from the store"
    assert first.kv_pull_bytes == 3 * block_bytes
    colocated_req = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling_params=params(2))
    first_colocated = next(iter(DecodeCall(decode.decode, colocated_req, timeout=60)))
    assert not first_colocated.HasField("kv_pull_ns")
    assert not first_colocated.HasField("kv_pull_bytes")
