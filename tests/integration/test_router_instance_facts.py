"""What the router knows of the model comes from its engines: context length, vocabulary,
architecture and implementation, as each instance reports them in GetLoad (and in its
registry entry), never from the model's files.

Before, the router read the context length from the model's config at start-up, so an
engine started with a smaller ``--max-model-len`` (the usual way to fit a long-context model
in memory) got prompts the router had accepted and failed them, and an engine serving
another model under the same name was routed to like any other.

Real gRPC servers in the test process answer the load polls (their reports are what each
test sets: no real engine reports another vocabulary than its model's on demand); the
router's real ``InstancePool`` polls them into a ``StaticDiscovery``. The Redis test reads
entries written by the real registration writer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from types import SimpleNamespace

import httpx
import pytest
from ports import free_port
from redis_server import RedisServer
from services_harness import grpc_servicer_in_thread, tiny_model_dir

from tandem.contracts.role import Role
from tandem.launch import Part, http_ok, start_part, stop_parts, tandem_argv, wait_ready
from tandem.services.common.registry import InstanceRegistration
from tandem.services.router.client import InstancePool
from tandem.services.router.discovery import RedisDiscovery, ServedFacts, StaticDiscovery
from tandem.services.router.frontend import Frontend
from tandem.v1 import common_pb2, decode_pb2_grpc

VOCAB = 49152
ARCH = "LlamaForCausalLM"


class _Reporting(decode_pb2_grpc.DecodeServiceServicer):
    """An instance whose GetLoad reports the facts the test sets."""

    def __init__(self, max_model_len: int, vocab_size: int = VOCAB,
                 model_impl: str = "tandem") -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.model_impl = model_impl

    async def GetLoad(self, request, context):  # noqa: ANN001, ANN201, N802
        return common_pb2.GetLoadResponse(
            role="both", model="m", max_model_len_tokens=self.max_model_len,
            vocab_size_tokens=self.vocab_size, architecture=ARCH if self.vocab_size else "",
            model_impl=self.model_impl)


@pytest.fixture
def instances() -> Iterator[list[tuple[_Reporting, str]]]:
    """Three instances: 4096 tokens native, 2048 through transformers, and 1024 tokens
    of a model with another vocabulary."""
    servicers = [_Reporting(4096), _Reporting(2048, model_impl="transformers"),
                 _Reporting(1024, vocab_size=VOCAB + 64)]
    with ExitStack() as stack:
        yield [(s, stack.enter_context(grpc_servicer_in_thread(
            decode_pb2_grpc.add_DecodeServiceServicer_to_server, s))) for s in servicers]


def _poll(addresses: list[str], rounds: int = 1,
          between: object = None) -> tuple[StaticDiscovery, list[ServedFacts], list[list[str]]]:
    """Poll ``addresses`` ``rounds`` times through the router's pool; returns the discovery
    and, per round, its facts and the addresses it routes to (``between(round)`` runs
    before each round after the first)."""
    async def main() -> tuple[StaticDiscovery, list[ServedFacts], list[list[str]]]:
        d = StaticDiscovery(both=addresses)
        pool = InstancePool(d)
        facts, routed = [], []
        try:
            for r in range(rounds):
                if r and callable(between):
                    between(r)
                await pool.poll_loads()
                facts.append(d.facts)
                routed.append(sorted(i.address for i in d.instances(Role.BOTH)))
        finally:
            await pool.close()
        return d, facts, routed

    return asyncio.run(main())


def test_facts_are_the_smallest_context_and_what_runs_the_model(instances) -> None:
    (_, a), (_, b), _ = instances
    d, facts, routed = _poll([a, b])
    assert facts == [ServedFacts(max_model_len=2048, vocab_size=VOCAB, architecture=ARCH,
                                 model_impl="tandem,transformers")]
    assert routed == [sorted([a, b])]
    info = d.get(a)
    assert info is not None and (info.max_model_len, info.vocab_size, info.model_impl) == (
        4096, VOCAB, "tandem")


def test_an_instance_of_another_vocabulary_is_logged_once_and_not_routed_to(
        instances, caplog: pytest.LogCaptureFixture) -> None:
    """Its (smaller) context length does not lower the model's either; once it reports the
    vocabulary of the others it is routed to again."""
    (_, a), (_, b), (odd, c) = instances

    def fix(r: int) -> None:
        if r == 2:
            odd.vocab_size = VOCAB

    with caplog.at_level(logging.INFO, logger="tandem.services.router.discovery"):
        _, facts, routed = _poll([a, b, c], rounds=3, between=fix)
    assert routed[:2] == [sorted([a, b])] * 2
    assert [f.max_model_len for f in facts[:2]] == [2048, 2048]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors  # once, not on every poll
    assert c in errors[0] and str(VOCAB + 64) in errors[0] and str(VOCAB) in errors[0]
    assert routed[2] == sorted([a, b, c]) and facts[2].max_model_len == 1024
    assert any(c in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_the_only_instance_of_another_vocabulary_is_not_routed_to_even_as_a_last_resort(
        instances) -> None:
    """Two against one: the odd one out is refused though benched instances would be
    tried when nothing else is left (it serves another model: a 503 is the answer)."""
    (_, a), (_, b), (_, c) = instances
    d, _, _ = _poll([a, b, c])
    d.mark_failed(a)
    d.mark_failed(b)
    assert sorted(i.address for i in d.instances(Role.BOTH)) == sorted([a, b])
    assert not any(i.address == c for i in d.instances(Role.BOTH, exclude={a, b}))
    assert d.refused(c) and d.refused(a) is None


def test_an_engine_that_reports_no_facts_leaves_them_unknown(instances) -> None:
    """An engine older than the fields (0 / ""): nothing is refused, no limit invented."""
    (old, a), _, _ = instances
    old.max_model_len, old.vocab_size, old.model_impl = 0, 0, ""
    _, facts, routed = _poll([a])
    assert facts == [ServedFacts()] and routed == [[a]]


class _Tokenizer:
    chat_template = None

    def __len__(self) -> int:
        return VOCAB


@pytest.mark.parametrize(("cap", "reported", "want"), [
    (None, None, None), (512, None, 512), (None, 2048, 2048), (512, 2048, 512),
    (4096, 2048, 2048)])
def test_the_router_validates_against_the_reported_length_capped_by_its_flag(
        cap: int | None, reported: int | None, want: int | None) -> None:
    d = StaticDiscovery()
    d.facts = ServedFacts(max_model_len=reported, vocab_size=VOCAB + 64 if reported else None)
    fe = Frontend(tokenizer=_Tokenizer(), pipeline=SimpleNamespace(discovery=d),  # type: ignore[arg-type]
                  served_model_names=["m"], max_model_len=cap)
    assert fe.max_model_len == want
    # vLLM's rule: ids past the tokenizer's but inside the model's vocabulary are valid
    assert fe.vocab_size == (VOCAB + 64 if reported else VOCAB)


def test_registry_entries_carry_the_facts() -> None:
    """The registry's fields (as ``ServiceContext.registry_load`` writes them) give the
    router the facts before its first poll."""
    server = RedisServer(free_port())
    server.start()
    url = server.url

    def entry(address: str, vocab: int, max_len: int) -> InstanceRegistration:
        async def load() -> dict[str, float | int | str]:
            return {"running": 0, "waiting": 0, "kv_usage": 0.0, "num_free_blocks": 1,
                    "max_model_len_tokens": max_len, "vocab_size_tokens": vocab,
                    "architecture": ARCH, "model_impl": "tandem"}

        return InstanceRegistration(url, Role.BOTH, address.replace(":", "-"), address, "m",
                                    load)

    async def main() -> tuple[ServedFacts, list[str]]:
        regs = [entry("10.0.0.1:1", VOCAB, 4096), entry("10.0.0.2:1", VOCAB, 1024),
                entry("10.0.0.3:1", VOCAB + 1, 512)]
        d = RedisDiscovery(url, model="m")
        try:
            for reg in regs:
                await reg.beat()
            await d.refresh()
            return d.facts, sorted(i.address for i in d.instances(Role.BOTH))
        finally:
            await d.stop()
            for reg in regs:
                await reg.stop()

    try:
        facts, routed = asyncio.run(main())
    finally:
        server.stop()
    assert facts == ServedFacts(max_model_len=1024, vocab_size=VOCAB, architecture=ARCH,
                                model_impl="tandem")
    assert routed == ["10.0.0.1:1", "10.0.0.2:1"]


def test_a_router_without_max_model_len_starts_and_answers_503_before_any_report(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """No engine up: the router starts without reading a context length, its model card
    has none yet, and a request (even a long one) gets the pipeline's 503, never a 500."""
    model = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    part = Part("router", tandem_argv(
        "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
        "--model", model, "--colocated", f"127.0.0.1:{free_port()}"),
        lambda: http_ok(f"{url}/health", timeout_s=1))
    proc = start_part(part, log_path=tmp_path_factory.mktemp("router") / "router.log",
                      env=dict(os.environ))
    try:
        wait_ready([part], 120)
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        assert card["max_model_len"] is None and card["architecture"] is None
        for n in (4, 5000):
            resp = httpx.post(f"{url}/v1/completions", timeout=30, json={
                "model": card["id"], "prompt": [5] * n, "max_tokens": 2})
            assert resp.status_code == 503, resp.text
        resp = httpx.post(f"{url}/v1/completions", timeout=30, json={
            "model": card["id"], "prompt": [VOCAB], "max_tokens": 2})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        stop_parts([part], timeout_s=0)
