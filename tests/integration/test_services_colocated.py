"""The colocated engine service (`tandem serve --role both`) over real gRPC: no store needed.

Covers the parts every role shares: the engine thread bridge, the error mapping,
cancellation freeing blocks, health and graceful SIGTERM. Tiny random Llama, float32,
oracle transformers ``generate(do_sample=False)``.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from ports import free_port
from services_harness import (
    EngineService,
    hf_greedy,
    params,
    run_colocated,
    wait_for,
)

from tandem.services.decode.client import DecodeCall
from tandem.v1 import common_pb2, decode_pb2

ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "32", "--block-size", "16"]


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def svc(tiny, metrics_port, tmp_path_factory):
    service = EngineService("both", tiny, tmp_path_factory.mktemp("both"), None,
                            [*ARGS, "--metrics-port", str(metrics_port)])
    yield service
    assert service.stop() == 0, "colocated service did not exit cleanly on SIGTERM"


def test_greedy_matches_transformers_with_chunked_prefill(tiny, svc):
    prompts = [[7, 8, 9], list(range(1000, 1100)), list(range(3000, 3017))]  # 100 > 64: chunked
    want = hf_greedy(tiny, prompts, max_new_tokens=10)
    got = [run_colocated(svc, p, params(10)) for p in prompts]
    assert got == want


def test_stream_shape_and_usage_fields(svc):
    msgs = list(DecodeCall(svc.decode, decode_pb2.DecodeRequest(
        prompt_token_ids=[1, 2, 3, 4], sampling_params=params(3)), timeout=60))
    # NOTE: tokens ready together travel in one message (RequestStream.batches): how many
    # messages carry the 3 tokens depends on whether the handler kept up with the engine
    # (a loaded host gave one message of 3), so only the stream's content is fixed.
    assert sum(len(m.token_ids) for m in msgs) == 3 and all(m.token_ids for m in msgs)
    assert [m.finish_reason for m in msgs[:-1]] == [0] * (len(msgs) - 1)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[0].HasField("num_cached_tokens") and not msgs[0].HasField("kv_pull_ns")


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 49152]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -5]}, "prompt_token_ids"),
        ({"sampling_params": common_pb2.SamplingParams(top_k=0)}, "top_k"),
        ({"sampling_params": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"sampling_params": common_pb2.SamplingParams(stop_token_ids=[10**7])}, "stop_token_ids"),
        ({"sampling_params": common_pb2.SamplingParams(presence_penalty=3)}, "presence_penalty"),
        ({"block_hashes": [b"h" * 32]}, "block_hashes"),
        ({"prompt_token_ids": list(range(1, 1100))}, "prompt_token_ids"),  # > context (1024)
        ({"output_token_ids": [4, 10**6]}, "output_token_ids"),
        ({"output_token_ids": [4, 5]}, "output_token_ids"),  # max_tokens 2: nothing left
        ({"output_token_ids": [4], "first_token_id": 5}, "output_token_ids"),
        ({"output_token_ids": [4] * 1030, "sampling_params": params(2000)}, "output_token_ids"),
    ],
)
def test_bad_requests_are_invalid_argument(svc, request_kwargs, field):
    kwargs = {"prompt_token_ids": [1, 2, 3], "sampling_params": params(2), **request_kwargs}
    with pytest.raises(grpc.RpcError) as err:
        list(DecodeCall(svc.decode, decode_pb2.DecodeRequest(**kwargs), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 40, "seed": 77}],
                         ids=["greedy", "seeded"])
def test_output_token_ids_resume_a_request(svc, sampling):
    """A request resumed from the tokens another instance delivered (request migration)
    continues with exactly the tokens of an uninterrupted run: greedy, and seeded (its
    draws are keyed by output position, so no generator state travels)."""
    prompt = list(range(40, 60))
    sp = params(24, ignore_eos=True, **sampling)
    whole = run_colocated(svc, prompt, sp)
    assert len(whole) == 24
    resumed: list[int] = []
    req = decode_pb2.DecodeRequest(prompt_token_ids=prompt, sampling_params=sp,
                                   output_token_ids=whole[:10])
    msgs = list(DecodeCall(svc.decode, req, timeout=60))
    for m in msgs:
        resumed.extend(m.token_ids)
    assert resumed == whole[10:]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_prompt_that_never_fits_is_resource_exhausted(svc):
    # 32 blocks of 16 tokens = 512 tokens of KV cache; the context is 1024.
    req = decode_pb2.DecodeRequest(prompt_token_ids=list(range(1, 600)),
                                   sampling_params=params(2))
    with pytest.raises(grpc.RpcError) as err:
        list(DecodeCall(svc.decode, req, timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert run_colocated(svc, [5, 6], params(2)), "other requests are undisturbed"


def test_duplicate_in_flight_request_id_is_invalid_argument(svc):
    long = decode_pb2.DecodeRequest(request_id="dup", prompt_token_ids=[1, 2, 3],
                                    sampling_params=params(300, ignore_eos=True))
    call = DecodeCall(svc.decode, long, timeout=60)
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        list(DecodeCall(svc.decode, long, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in err.value.details()
    call.cancel()


def test_cancel_and_deadline_free_all_blocks(svc):
    total = svc.get_load().num_total_blocks
    call = DecodeCall(svc.decode, decode_pb2.DecodeRequest(
        prompt_token_ids=list(range(10, 90)), sampling_params=params(400, ignore_eos=True)),
        timeout=60)
    next(call)
    assert svc.get_load().num_running_requests == 1
    call.cancel()
    wait_for(lambda: svc.get_load().num_running_requests == 0, 30, "request aborted")
    assert svc.get_load().num_free_blocks == total
    # The deadline must fall while the request runs, on any machine: a quarter of what the
    # whole request takes here (a fixed 0.5 s let a fast host finish all 400 tokens).
    req = decode_pb2.DecodeRequest(prompt_token_ids=list(range(10, 90)),
                                   sampling_params=params(400, ignore_eos=True))
    start = time.monotonic()
    assert sum(len(m.token_ids) for m in DecodeCall(svc.decode, req, timeout=60)) == 400
    took = time.monotonic() - start
    with pytest.raises(grpc.RpcError) as err:
        list(DecodeCall(svc.decode, req, timeout=took / 4))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: svc.get_load().num_free_blocks == total, 30, "pool back to full")


def test_sigterm_drains_in_flight_requests_then_exits(tiny, tmp_path, redis_url):
    import redis

    service = EngineService("both", tiny, tmp_path, redis_url,
                            [*ARGS, "--shutdown-grace-s", "60"])
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    mine = [k for k in r.scan_iter("tandem:instance:both:*")
            if r.hget(k, "address") == service.address]
    try:
        assert len(mine) == 1, "registered as role both"
        call = DecodeCall(service.decode, decode_pb2.DecodeRequest(
            prompt_token_ids=[3, 4, 5], sampling_params=params(40, ignore_eos=True)), timeout=120)
        first = next(call)
        service.proc.popen.send_signal(signal.SIGTERM)
        rest = list(call)
        tokens = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert len(tokens) == 40, "the in-flight request must finish during the grace period"
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert service.proc.popen.wait(60) == 0
        assert not r.exists(mine[0]), "the registry entry is deleted on shutdown"
    finally:
        service.stop()


def test_sigterm_ends_an_open_decode_stream_once_its_streams_are_over(tiny, tmp_path,
                                                                      redis_url):
    """A router keeps its DecodeStream call open; on SIGTERM the engine finishes the
    stream in flight, then ends the call itself and exits, instead of waiting out its
    grace period (600 s here) for a caller that never closes."""
    import queue

    service = EngineService("both", tiny, tmp_path, redis_url,
                            [*ARGS, "--shutdown-grace-s", "600"])
    outgoing: queue.Queue = queue.Queue()

    def requests():
        while (msg := outgoing.get()) is not None:
            yield msg

    try:
        outgoing.put(decode_pb2.DecodeStreamRequest(stream=0, start=decode_pb2.DecodeRequest(
            request_id="s0", prompt_token_ids=[3, 4, 5],
            sampling_params=params(40, ignore_eos=True))))
        responses = service.decode.DecodeStream(requests(), timeout=300)
        first = next(responses)
        service.proc.popen.send_signal(signal.SIGTERM)
        items = [i for r in [first, *responses] for i in r.items]  # ends: the call is over
        assert sum(len(i.response.token_ids) for i in items) == 40
        assert items[-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert service.proc.popen.wait(120) == 0
    finally:
        outgoing.put(None)
        service.stop()


def test_prometheus_metrics(svc, metrics_port):
    import urllib.request

    run_colocated(svc, [9, 9, 9], params(2))

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    text = scrape()
    assert 'tandem:request_success_total{finished_reason="length",role="both"}' in text
    assert "tandem:time_to_first_token_seconds_count" in text
    wait_for(lambda: 'tandem:kv_cache_usage_perc{role="both"}' in scrape(), 30, "gauges")
