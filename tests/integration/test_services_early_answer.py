"""The prefill answers before its KV publish ends; the decode side waits for the blocks.

Real processes (a prefill and a decode service, a `tandem kvstore` node, Redis), the tiny
random Llama in float32, transformers' greedy output as the oracle. The publish is held
back for real: the store node is stopped (SIGSTOP) before the prefill, so the prefill's
put cannot complete; the prefill's answer arrives anyway, the decode parks its load
(``tandem:num_kv_loads_waiting``), and after SIGCONT it loads every block. Killing the
stopped node makes the publish fail: the prefill marks it failed, the decode stops
waiting at once (its wait is 60 s) and recomputes.

NOTE: the tests run in file order on purpose: the last one kills the module's store node.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from services_harness import (
    KVStoreNode,
    MeteredEngine,
    decode_request_from,
    hf_greedy,
    params,
    random_prompt,
    run_colocated,
    run_disaggregated,
)

from tandem.services.decode.client import DecodeCall
from tandem.v1 import prefill_pb2

ENGINE_ARGS = ["--num-kv-blocks", "128", "--block-size", "16"]
#: The decode's wait is far longer than any test: a wait that ends early ended for a reason.
DECODE_ARGS = [*ENGINE_ARGS, "--kv-load-wait-s", "60"]


@pytest.fixture(scope="module")
def store(redis_url, tmp_path_factory) -> Iterator[KVStoreNode]:
    """The module's own store node (the last test kills it)."""
    node = KVStoreNode(redis_url, tmp_path_factory.mktemp("store"))
    yield node
    if node.proc.alive():
        os.kill(node.proc.popen.pid, signal.SIGCONT)
        node.stop()


@pytest.fixture(scope="module")
def cluster(tiny, redis_url, store, tmp_path_factory) -> Iterator[list[MeteredEngine]]:
    """(prefill, decode)."""
    tmp = tmp_path_factory.mktemp("early-answer")
    started: list[MeteredEngine] = []
    try:
        started.append(MeteredEngine("prefill", tiny, tmp, redis_url, ENGINE_ARGS))
        started.append(MeteredEngine("decode", tiny, tmp, redis_url, DECODE_ARGS))
        yield started
    finally:
        for inst in started:
            inst.svc.stop()


def _stopped(store: KVStoreNode) -> None:
    os.kill(store.proc.popen.pid, signal.SIGSTOP)


def _resumed(store: KVStoreNode) -> None:
    os.kill(store.proc.popen.pid, signal.SIGCONT)


def test_greedy_output_is_unchanged(tiny, cluster):
    prefill, decode = cluster
    prompts = [random_prompt(1, 37), random_prompt(2, 100)]
    for prompt, want in zip(prompts, hf_greedy(tiny, prompts, 8), strict=True):
        got, _ = run_disaggregated(prefill.svc, decode.svc, prompt, params(8))
        assert got == want, f"disaggregated, prompt of {len(prompt)} tokens"
        assert run_colocated(decode.svc, prompt, params(8)) == want, "colocated"


def _prefill_while_stopped(prefill: MeteredEngine, store: KVStoreNode, prompt: list[int]
                           ) -> prefill_pb2.PrefillResponse:
    """Stop the store node, then prefill: the answer comes with the publish in flight."""
    _stopped(store)
    pre = prefill.svc.prefill.Prefill(prefill_pb2.PrefillRequest(
        prompt_token_ids=prompt, sampling_params=params(8)), timeout=60)
    assert pre.kv_publish_pending, "the publish cannot have ended: the store is stopped"
    assert pre.publish_ns == 0
    return pre


def test_the_prefill_answers_while_the_store_is_stopped(tiny, store, cluster):
    prefill, decode = cluster
    prompt = random_prompt(3, 80)  # 5 blocks
    arrived = decode.metric("tandem:kv_load_waits_total", outcome="arrived")
    failures = decode.svc.get_load().num_kv_load_failures
    try:
        pre = _prefill_while_stopped(prefill, store, prompt)
        call = DecodeCall(decode.svc.decode, decode_request_from(pre, prompt, params(8)), timeout=120)
        decode.wait_metric("tandem:num_kv_loads_waiting", 1)
    finally:
        _resumed(store)
    msgs = list(call)
    assert [pre.first_token_id] + [t for m in msgs for t in m.token_ids] == \
        hf_greedy(tiny, [prompt], 8)[0]
    assert msgs[0].num_cached_tokens == len(prompt), "every block loaded, none recomputed"
    assert decode.metric("tandem:kv_load_waits_total", outcome="arrived") == arrived + 1
    assert decode.svc.get_load().num_kv_load_failures == failures
    prefill.wait_metric("tandem:kv_publish_seconds_count",
                        prefill.metric("tandem:kv_publish_seconds_count"))


def test_a_failed_publish_ends_the_wait_and_decode_recomputes(tiny, store, cluster):
    prefill, decode = cluster
    prompt = random_prompt(4, 70)
    failed = decode.metric("tandem:kv_load_waits_total", outcome="publish_failed")
    try:
        pre = _prefill_while_stopped(prefill, store, prompt)
        call = DecodeCall(decode.svc.decode, decode_request_from(pre, prompt, params(8)), timeout=120)
        decode.wait_metric("tandem:num_kv_loads_waiting", 1)
    finally:
        store.proc.kill()  # the publish in flight fails
    msgs = list(call)
    assert [pre.first_token_id] + [t for m in msgs for t in m.token_ids] == \
        hf_greedy(tiny, [prompt], 8)[0], "recomputed output must be unchanged"
    assert msgs[0].num_cached_tokens == 0, "nothing was loaded"
    assert decode.metric("tandem:kv_load_waits_total", outcome="publish_failed") == failed + 1
