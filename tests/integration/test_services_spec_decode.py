"""Speculative decoding in the decode service: prefill -> KV store -> decode over real
gRPC services, a real store and real Redis, with prompt lookup on both engines.

The decode engine proposes from the prompt it received and the first token, verifies
in its own steps, and streams each accepted run in one message. Oracle: transformers
``generate(do_sample=False)`` in float32, token for token (what the same services give
without speculation, test_services_disagg.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from services_harness import (
    decode_request_from,
    hf_greedy,
    params,
    run_colocated,
    run_disaggregated,
    wait_for,
)

from tandem.services.decode.client import DecodeCall
from tandem.v1 import prefill_pb2

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16",
               "--speculative-config", SPEC]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama whose greedy output falls into short loops (transformers' default
    init), so prompt lookup's drafts are accepted, after some are rejected."""
    from tiny_models import tiny_config, tiny_hf_model

    folder: Path = tmp_path_factory.mktemp("spec-tiny")
    config = tiny_config("LlamaForCausalLM", vocab=512, hidden=64, ffn=128, max_len=512,
                         special_tokens=False, initializer_range=0.05)
    tiny_hf_model(config, seed=5).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def test_disaggregated_greedy_with_prompt_lookup_matches_transformers(tiny, prefill, decode):
    rng = random.Random(0)
    prompts = []
    for n in (7, 20, 45, 100):
        pattern = [rng.randrange(0, 512) for _ in range(n // 3 + 1)]
        prompts.append((pattern * 4)[:n])
    want = hf_greedy(tiny, prompts, max_new_tokens=30)
    multi = 0
    for prompt, expected in zip(prompts, want, strict=True):
        assert run_colocated(decode, prompt, params(30)) == expected, "colocated"
        pre = prefill.prefill.Prefill(
            prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=params(30)),
            timeout=60)
        msgs = list(DecodeCall(decode.decode, decode_request_from(pre, prompt, params(30)),
                                         timeout=60))
        got = [pre.first_token_id] + [t for m in msgs for t in m.token_ids]
        assert got == expected, f"disaggregated, prompt of {len(prompt)} tokens"
        multi += sum(len(m.token_ids) > 1 for m in msgs)
    # Accepted drafts arrive as runs of several tokens in one message.
    assert multi > 0


def test_max_tokens_and_stop_inside_an_accepted_run(tiny, prefill, decode):
    prompt = [3, 4, 5, 6] * 6
    full = hf_greedy(tiny, [prompt], max_new_tokens=30)[0]
    for max_tokens in (2, 5, 11):
        got, _ = run_disaggregated(prefill, decode, prompt, params(max_tokens))
        assert got == full[:max_tokens]
    stop = full[9]
    got, _ = run_disaggregated(prefill, decode, prompt, params(30, stop_token_ids=[stop]))
    assert got == full[: full.index(stop) + 1]


def test_draft_model_decode_builds_the_draft_kv_itself(tiny, prefill, redis_url, store,
                                                       tmp_path_factory):
    """A decode instance with a draft model (here the target's own weights): the target's
    KV for the prompt comes from the store, the draft's is computed on the decode side
    (the prefill instance runs no draft); greedy output equals transformers'."""
    from services_harness import EngineService

    spec = f'{{"method": "draft_model", "model": "{tiny}", "num_speculative_tokens": 3}}'
    args = [*ENGINE_ARGS[:-2], "--speculative-config", spec]
    svc = EngineService("decode", tiny, tmp_path_factory.mktemp("draft-decode"), redis_url, args)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(0, 512) for _ in range(n)] for n in (9, 40, 90)]
        want = hf_greedy(tiny, prompts, max_new_tokens=20)
        multi = 0
        for prompt, expected in zip(prompts, want, strict=True):
            pre = prefill.prefill.Prefill(
                prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling_params=params(20)),
                timeout=60)
            msgs = list(DecodeCall(svc.decode, decode_request_from(pre, prompt, params(20)),
                                          timeout=60))
            got = [pre.first_token_id] + [t for m in msgs for t in m.token_ids]
            assert got == expected, f"prompt of {len(prompt)} tokens"
            multi += sum(len(m.token_ids) > 1 for m in msgs)
        assert multi > 0
        # The decode engine publishes each finished request's blocks (the store tier)
        # and frees them once the put is done.
        wait_for(lambda: (load := svc.get_load()).num_free_blocks == load.num_total_blocks,
                 30, "decode pool back to full")
    finally:
        assert svc.stop() == 0
