"""Router pieces without processes: routing policies, discovery bookkeeping, request models."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tandem.services.router.discovery import InstanceInfo, StaticDiscovery, _parse_entry
from tandem.services.router.errors import OpenAIError
from tandem.services.router.protocol import ChatCompletionRequest, CompletionRequest
from tandem.services.router.routing import (
    KVAwareRouter,
    LeastLoadedRouter,
    RoundRobinRouter,
    RouteContext,
    make_router,
)


def _infos(*loads: int, role: str = "prefill") -> list[InstanceInfo]:
    return [InstanceInfo(role=role, address=f"10.0.0.{i}:1", running=n)
            for i, n in enumerate(loads)]


def _choose(router, infos, prompt=(1, 2, 3), stage="prefill") -> InstanceInfo:  # noqa: ANN001
    return asyncio.run(router.choose(infos, RouteContext(stage, list(prompt))))


def test_round_robin_cycles_over_all() -> None:
    infos = _infos(0, 0, 0)
    router = RoundRobinRouter()
    picks = [_choose(router, infos).address for _ in range(6)]
    assert picks == [i.address for i in infos] * 2


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
@pytest.mark.parametrize(("num_prefill", "num_decode"), [(2, 2), (2, 3), (3, 2), (3, 3)])
def test_each_stage_rotates_on_its_own(policy, num_prefill, num_decode) -> None:
    """Requests placed as the pipeline places them (a prefill choice, then a decode
    choice), on idle instances with distinct prompts: the prefill choices cycle over every
    prefill instance and the decode choices over every decode instance. With one rotation
    for both stages, two prefill instances got every prefill (round robin, and the
    least-loaded tie-break of the other two policies)."""
    router = make_router(policy)
    prefill = _infos(*[0] * num_prefill)
    decode = [InstanceInfo(role="decode", address=f"10.0.1.{i}:1") for i in range(num_decode)]
    picks: dict[str, list[str]] = {"prefill": [], "decode": []}
    for n in range(6):
        for stage, infos in (("prefill", prefill), ("decode", decode)):
            ctx = RouteContext(stage, [1000 + 64 * n + j for j in range(40)])
            info = _choose(router, infos, ctx.prompt_token_ids, stage)
            router.on_routed(info, ctx)
            picks[stage].append(info.address)
    assert picks["prefill"] == [i.address for i in prefill] * (6 // num_prefill)
    assert picks["decode"] == [i.address for i in decode] * (6 // num_decode)


def test_least_loaded_uses_reports_and_own_inflight() -> None:
    infos = _infos(3, 1, 2)
    assert _choose(LeastLoadedRouter(), infos).address == "10.0.0.1:1"
    infos[1].inflight = 5  # our own count is fresher than the report
    assert _choose(LeastLoadedRouter(), infos).address == "10.0.0.2:1"


def test_kv_aware_prefers_cached_prefix_within_load_slack() -> None:
    router = KVAwareRouter(balance_slack=2)
    infos = _infos(0, 0)
    shared = list(range(100, 164))  # four full 16-token blocks
    first = _choose(router, infos, shared + [1])
    router.on_routed(first, RouteContext("prefill", shared + [1]))
    other = next(i for i in infos if i is not first)
    # Same prefix, equal load: the instance that has it wins every time.
    for tail in ([2], [3, 4], [5, 6, 7]):
        assert _choose(router, infos, shared + tail) is first
    assert router.matched_blocks(first.address, RouteContext("prefill", shared)) == 4
    # A prompt without that prefix goes by load.
    other.running, first.running = 0, 1
    assert _choose(router, infos, list(range(900, 964))) is other
    # Too busy (beyond the slack): the prefix match no longer wins.
    first.running = 5
    assert _choose(router, infos, shared + [9]) is other


def test_kv_aware_decode_is_least_loaded() -> None:
    router = KVAwareRouter()
    infos = _infos(4, 0, 2, role="decode")
    assert _choose(router, infos, stage="decode").address == "10.0.0.1:1"


def test_make_router_by_name() -> None:
    assert isinstance(make_router("round_robin"), RoundRobinRouter)
    assert isinstance(make_router("kv_aware"), KVAwareRouter)
    with pytest.raises(ValueError, match="routing_policy"):
        make_router("random")


def test_an_instance_is_down_when_benched_unanswered_or_gone() -> None:
    d = StaticDiscovery(decode=["c:1", "d:1"])
    assert not d.is_down("c:1")
    d.mark_failed("c:1")
    assert d.is_down("c:1")
    d.mark_ok("c:1")
    assert not d.is_down("c:1")
    info = d.get("d:1")
    assert info is not None
    info.alive = False  # its last load poll failed
    assert d.is_down("d:1")
    assert d.is_down("e:1")  # not in the view


def test_static_discovery_benches_failed_instances() -> None:
    d = StaticDiscovery(prefill=["a:1", "b:1"], decode=["c:1"])
    assert {i.address for i in d.instances("prefill")} == {"a:1", "b:1"}
    d.mark_failed("a:1")
    assert [i.address for i in d.instances("prefill")] == ["b:1"]
    d.mark_failed("b:1")  # nothing healthy left: fall back to all rather than none
    assert len(d.instances("prefill")) == 2
    assert [i.address for i in d.instances("prefill", exclude={"a:1"})] == ["b:1"]
    d.acquire("c:1")
    d.acquire("c:1")
    assert d.instances("decode")[0].inflight == 2
    d.release("c:1")
    d.release("c:1")
    assert d.instances("decode")[0].inflight == 0
    with pytest.raises(ValueError, match="listed twice"):
        StaticDiscovery(prefill=["a:1"], decode=["a:1"])


def test_registry_entry_parsing() -> None:
    info = _parse_entry("tandem:instance:decode:x", {
        "role": "decode", "address": "h:5", "model": "m", "running": "2", "waiting": "1",
        "kv_usage": "0.5", "num_free_blocks": "10", "updated_at": "1.5"})
    assert (info.role, info.address, info.load, info.kv_usage) == ("decode", "h:5", 3, 0.5)
    assert _parse_entry("tandem:instance:bogus:x", {"role": "bogus", "address": "h:1"}) is None
    assert _parse_entry("tandem:instance:decode:x", {"role": "decode"}) is None
    assert _parse_entry("tandem:instance:decode:x",
                        {"role": "decode", "address": "h:1", "running": "lots"}) is None


def test_context_length_and_defaults() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    sp = req.to_sampling_params(num_prompt_tokens=10, max_model_len=100)
    assert sp.max_tokens == 90 and sp.temperature == 1.0 and sp.logprobs is None
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                max_completion_tokens=7, logprobs=True, top_logprobs=2)
    sp = req.to_sampling_params(num_prompt_tokens=10, max_model_len=100)
    assert sp.max_tokens == 7 and sp.logprobs == 2
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(prompt="x", max_tokens=91).to_sampling_params(
            num_prompt_tokens=10, max_model_len=100)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(prompt="x").to_sampling_params(num_prompt_tokens=100,
                                                         max_model_len=100)
    assert info.value.code == "context_length_exceeded"


def test_unknown_fields_ignored_with_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        req = CompletionRequest(prompt="x", frobnicate=1, stop="END", top_k=5)
    assert "frobnicate" in caplog.text
    sp = req.to_sampling_params(num_prompt_tokens=1, max_model_len=100)
    assert sp.stop == ["END"] and sp.top_k == 5


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_json": True}, "guided_json"),  # a union: dict | str
    ({"guided_choice": "red"}, "guided_choice"),
    # list indices in brackets, as the router's own errors write them (was messages.0.content)
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"max_tokens": "many"}, "max_tokens"),
])
def test_validation_errors_name_the_request_field(body, param) -> None:
    """A value that fails a field's type is a 400 whose ``param`` is the field's path in
    the request, without the union member pydantic tried (``guided_json.dict[str,any]``
    was reported)."""
    from pydantic import ValidationError

    from tandem.services.router.errors import from_validation_error

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi"}], **body})
    err = from_validation_error(info.value)
    assert err.status_code == 400 and err.param == param, err.param


class _FakeStoreIndex:
    """The store index: the leading keys whose hashes are in ``held``; counts lookups."""

    def __init__(self, held=()) -> None:  # noqa: ANN001
        self.held = set(held)
        self.num_lookups = 0

    async def leading(self, keys) -> int:  # noqa: ANN001
        self.num_lookups += 1
        n = 0
        for k in keys:
            if k.hash not in self.held:
                break
            n += 1
        return n


def test_kv_aware_weighs_local_and_store_tiers_with_one_lookup_per_request() -> None:
    from tandem.contracts.block_hash import hash_token_blocks
    from tandem.services.router.routing import CacheView

    shared = list(range(100, 164))  # four full 16-token blocks
    store = _FakeStoreIndex(hash_token_blocks(shared, 16)[:2])  # the store holds two
    view = CacheView(store)
    router = KVAwareRouter(view, balance_slack=2)
    infos = _infos(0, 0, 0)
    for i in infos:
        i.kv_layout_fingerprint = b"f" * 16
    ctx = RouteContext("prefill", shared + [1])
    first = asyncio.run(router.choose(infos, ctx))
    assert store.num_lookups == 1, "one lookup for all candidates"
    router.on_routed(first, ctx)
    # Another stage of the same request reuses the lookup.
    decode_ctx = ctx.for_stage("decode")
    est = asyncio.run(view.estimate(first, decode_ctx))
    assert (est.local_tokens, est.store_tokens, est.reused_tokens) == (64, 32, 64)
    assert store.num_lookups == 1
    # The instance with all four blocks local is cheaper than a store load of two.
    assert _choose(router, infos, shared + [2]) is first
    # Without local hints, the store's blocks are the same for everyone: load decides.
    others = [i for i in infos if i is not first]
    others[0].running, others[1].running = 1, 0
    picked = _choose(router, others, shared[:32] + [3])
    assert picked is others[1]
    assert store.num_lookups == 3
    # Before an instance reports its layout, the store is not asked.
    fresh = _infos(0)
    assert asyncio.run(view.store_tokens(fresh[0], RouteContext("prefill", shared))) == 0
    assert store.num_lookups == 3


def test_colocated_instances_do_not_ask_the_store() -> None:
    from tandem.services.router.routing import CacheView

    store = _FakeStoreIndex()
    router = KVAwareRouter(CacheView(store))
    infos = _infos(0, 0, role="both")
    for i in infos:
        i.kv_layout_fingerprint = b"f" * 16
    _choose(router, infos, list(range(64)), stage="both")
    assert store.num_lookups == 0
