"""The router's autoscaling signals on a real router over real engines, and the chart's
KEDA queries against what that router exports.

Real parts: `tandem serve --role prefill|decode` over the tiny random model, a KV store
node, `tandem router` subprocesses with static instance lists, the chart rendered by the
real Helm engine. Between the router and the prefill engine sits a relay in the test
process that forwards every call unchanged but can hold Prefill calls until the test
releases them (a prefill tier that is busy for as long as the test needs: a real
engine's step cannot be made long on demand); while it holds some, its load report adds
them to the engine's queue, as a busy engine's would.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import grpc
import httpx
import pytest
from keda_chart import KEDA_VALUES, query_metric, render, scaled_objects
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families
from services_harness import Proc, grpc_servicer_in_thread, hf_greedy, random_prompt, wait_for

from tandem.launch import http_ok
from tandem.v1 import prefill_pb2_grpc

#: Flags of the module's engine services (conftest's fixtures read them).
ENGINE_ARGS = ["--num-kv-blocks", "256", "--max-model-len", "512"]


class _GatedPrefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Forwards Prefill and GetLoad to ``target``; Prefill waits for ``gate`` first."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.gate = threading.Event()
        self.gate.set()
        self.num_held = 0
        self.num_forwarded = 0
        self._stub: prefill_pb2_grpc.PrefillServiceStub | None = None

    def _forward(self) -> prefill_pb2_grpc.PrefillServiceStub:
        # NOTE: made on first use, in the serving thread's event loop (an aio channel
        # belongs to the loop it was created in).
        if self._stub is None:
            self._stub = prefill_pb2_grpc.PrefillServiceStub(grpc.aio.insecure_channel(self.target))
        return self._stub

    async def Prefill(self, request, context):  # noqa: ANN001, ANN201, N802
        self.num_held += 1
        try:
            await asyncio.to_thread(self.gate.wait, 120)
        finally:
            self.num_held -= 1
        self.num_forwarded += 1
        metadata = [
            (m.key, m.value) for m in context.invocation_metadata() if m.key == "x-request-id"
        ]
        return await self._forward().Prefill(request, metadata=metadata, timeout=120)

    async def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802
        load = await self._forward().GetLoad(request, timeout=30)
        load.num_waiting_requests += self.num_held
        return load


@pytest.fixture(scope="module")
def relay(prefill) -> Iterator[tuple[_GatedPrefill, str]]:
    servicer = _GatedPrefill(prefill.address)
    with grpc_servicer_in_thread(
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server, servicer
    ) as address:
        yield servicer, address
    servicer.gate.set()


class _Router:
    def __init__(self, tiny: str, tmp, prefill: str, decode: str) -> None:
        port, self.grpc_port = free_port(), free_port()
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = Proc(
            [
                "router",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--grpc-port",
                str(self.grpc_port),
                "--model",
                tiny,
                "--prefill",
                prefill,
                "--decode",
                decode,
                "--max-model-len",
                "512",
                "--metrics-window-s",
                "600",
            ],
            tmp / f"router-{port}.log",
            ready=lambda: http_ok(f"{self.url}/health"),
        )
        self.proc.wait_ready(120)

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy token ids of ``prompt`` through the router's gRPC API."""
        from services_harness import params

        from tandem.v1 import generation_pb2, generation_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as ch:
            msgs = list(
                generation_pb2_grpc.GenerationServiceStub(ch).Generate(
                    generation_pb2.GenerateRequest(
                        token_ids=generation_pb2.TokenIds(ids=prompt),
                        sampling_params=params(max_tokens, ignore_eos=True),
                    ),
                    timeout=180,
                )
            )
        return [t for m in msgs for t in m.token_ids]

    def samples(self) -> list:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of sample ``name`` whose labels include ``labels``; None if absent."""
        for s in self.samples():
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
        return None


@pytest.fixture
def router(tiny, tmp_path, relay, decode) -> Iterator[_Router]:
    r = _Router(tiny, tmp_path, relay[1], decode.address)
    yield r
    r.proc.stop()


def test_gauges_follow_a_request_held_at_prefill(tiny, relay, router) -> None:
    gated, _ = relay
    r = router
    wait_for(
        lambda: (
            r.metric("tandem:router_role_num_instances", role="prefill") == 1
            and r.metric("tandem:router_role_num_instances", role="decode") == 1
        ),
        60,
        "the router to count one instance per role",
    )
    assert r.metric("tandem:router_prefill_backlog_tokens") == 0
    ttft = "tandem:router_time_to_first_token_seconds_window"
    assert r.metric(f"{ttft}_samples") == 0
    assert r.metric(ttft, quantile="0.5") is None  # no traffic yet: no percentile

    prompt = random_prompt(random.Random(41), 40)
    got: dict[str, list[int]] = {}
    forwarded = gated.num_forwarded
    gated.gate.clear()
    sender = threading.Thread(target=lambda: got.setdefault("ids", r.generate(prompt, 8)))
    sender.start()
    try:
        wait_for(
            lambda: r.metric("tandem:router_prefill_backlog_tokens") == len(prompt),
            60,
            "the held prompt's tokens in the router's prefill backlog",
        )
        assert r.metric("tandem:router_num_requests_running") == 1
        # the prefill instance reports the held request as queued; the router sums it
        wait_for(
            lambda: r.metric("tandem:router_role_num_requests_waiting", role="prefill") == 1,
            60,
            "the prefill queue in the role sum",
        )
        assert r.metric("tandem:router_role_num_requests_waiting", role="decode") == 0
    finally:
        gated.gate.set()
        sender.join(180)
    assert got["ids"] == hf_greedy(tiny, [prompt], max_new_tokens=8)[0]
    assert gated.num_forwarded == forwarded + 1  # prefilled by the engine behind the relay
    assert r.metric("tandem:router_prefill_backlog_tokens") == 0
    wait_for(
        lambda: r.metric("tandem:router_role_num_requests_waiting", role="prefill") == 0,
        60,
        "the prefill queue to drain in the role sum",
    )
    # One TTFT in the window: every percentile is that request's TTFT, which is also the
    # whole sum of the TTFT histogram.
    assert r.metric(f"{ttft}_samples") == 1
    ttft_s = r.metric("tandem:router_time_to_first_token_seconds_sum")
    assert ttft_s is not None and ttft_s > 0
    for q in ("0.5", "0.9", "0.99"):
        assert r.metric(ttft, quantile=q) == pytest.approx(ttft_s)
    itl = "tandem:router_inter_token_latency_seconds_window"
    assert r.metric(f"{itl}_samples") >= 1
    assert 0 < r.metric(itl, quantile="0.5") <= r.metric(itl, quantile="0.99")


def test_every_metric_the_scaled_objects_query_is_on_the_router(tiny, router) -> None:
    r = router
    prompt = random_prompt(random.Random(42), 24)
    assert r.generate(prompt, 6) == hf_greedy(tiny, [prompt], max_new_tokens=6)[0]
    samples = r.samples()
    queried = 0
    for role, obj in scaled_objects(render(KEDA_VALUES)).items():
        for trigger in obj["spec"]["triggers"]:
            name, labels = query_metric(trigger["metadata"]["query"])
            found = [s for s in samples if s.name == name and labels.items() <= s.labels.items()]
            assert found, f"{role}: {name}{labels} is not on the router's /metrics"
            queried += 1
    assert queried >= 6
    # The role sums agree with the per-instance series of the same scrape.
    by_key = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    decode_usage = [
        s.value
        for s in samples
        if s.name == "tandem:router_instance_kv_cache_usage_perc" and s.labels["role"] == "decode"
    ]
    assert len(decode_usage) == 1
    assert by_key[
        ("tandem:router_role_kv_cache_usage_perc", (("role", "decode"), ("stat", "mean")))
    ] == pytest.approx(decode_usage[0])
