"""The router's conditional disaggregation (services/router/pipeline.py): which requests
skip the prefill hop, by the prompt's uncached tokens and by the prefill instances'
outstanding prefills (Dynamo's ``max_prefill_queue_size``)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.contracts.role import Role
from tandem.services.router.client import InstancePool
from tandem.services.router.discovery import StaticDiscovery
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.pipeline import Pipeline
from tandem.services.router.routing import RoundRobinRouter, RouteContext
from tandem.services.router.sequence import Timings

PREFILL, DECODE = "127.0.0.1:1", "127.0.0.1:2"


def _pipeline(discovery: StaticDiscovery, **kwargs: int | bool) -> Pipeline:
    return Pipeline(tokenizer=None, discovery=discovery, pool=InstancePool(discovery),
                    router=RoundRobinRouter(), metrics=RouterMetrics("m"), **kwargs)


def _decide(pipeline: Pipeline, prompt_len: int) -> tuple[bool, Timings]:
    timings = Timings()
    route = RouteContext(stage=Role.PREFILL, prompt_token_ids=list(range(prompt_len)))
    info, local = asyncio.run(pipeline._disagg_decision(route, timings))
    assert info is None or info.address == DECODE
    return local, timings


def test_a_busy_prefill_instance_sends_the_prompt_to_the_decode_instance() -> None:
    discovery = StaticDiscovery(prefill=[PREFILL], decode=[DECODE])
    pipeline = _pipeline(discovery, disagg_max_prefill_queue=2)
    local, t = _decide(pipeline, 256)
    assert not local and t.disagg_reason == "prefill queue 0 < 2"
    discovery.acquire(PREFILL)
    assert not _decide(pipeline, 256)[0]
    discovery.acquire(PREFILL)  # two prefills outstanding on the only prefill instance
    local, t = _decide(pipeline, 256)
    assert local and t.disagg_decision == "local_prefill"
    assert t.disagg_reason == "prefill queue 2 >= 2"
    discovery.release(PREFILL)
    assert not _decide(pipeline, 256)[0]


def test_the_least_loaded_prefill_instance_counts() -> None:
    other = "127.0.0.1:3"
    discovery = StaticDiscovery(prefill=[PREFILL, other], decode=[DECODE])
    pipeline = _pipeline(discovery, disagg_max_prefill_queue=1)
    discovery.acquire(PREFILL)
    assert not _decide(pipeline, 256)[0]  # the other one is idle
    discovery.acquire(other)
    assert _decide(pipeline, 256)[0]


def test_both_rules_together_and_off() -> None:
    discovery = StaticDiscovery(prefill=[PREFILL], decode=[DECODE])
    both = _pipeline(discovery, disagg_min_uncached_tokens=64, disagg_max_prefill_queue=1)
    local, t = _decide(both, 32)
    assert local and t.disagg_reason.startswith("32 uncached tokens < 64")
    local, t = _decide(both, 256)
    assert not local and "prefill queue 0 < 1" in t.disagg_reason
    discovery.acquire(PREFILL)
    assert _decide(both, 256)[0]
    off = _pipeline(discovery)
    local, t = _decide(off, 256)
    assert not local and t.disagg_reason == "conditional disaggregation off"


def test_a_negative_queue_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="disagg_max_prefill_queue"):
        _pipeline(StaticDiscovery(prefill=[PREFILL], decode=[DECODE]),
                  disagg_max_prefill_queue=-1)


def test_no_prefill_instance_up_the_decode_instance_prefills() -> None:
    """Prefill fallback: with the only prefill instance failing its load poll (or none in
    the view) the decode instance prefills; one benched after a single failed call is
    still tried; with the fallback off the request goes to the prefill instance (and
    fails there) or is refused with a 503."""
    from tandem.services.router.errors import OpenAIError

    discovery = StaticDiscovery(prefill=[PREFILL], decode=[DECODE])
    pipeline = _pipeline(discovery)
    assert not _decide(pipeline, 256)[0]
    discovery.mark_failed(PREFILL)
    assert not _decide(pipeline, 256)[0], "one failed call sent the prompt to decode"
    discovery.get(PREFILL).alive = False  # its load poll failed
    local, t = _decide(pipeline, 256)
    assert local and t.disagg_decision == "local_prefill"
    assert t.disagg_reason == "no prefill instance is up"
    assert pipeline.mode() == "disagg"
    discovery.get(PREFILL).alive = True
    assert not _decide(pipeline, 256)[0]

    off = _pipeline(discovery, disagg_prefill_fallback=False)
    discovery.get(PREFILL).alive = False
    assert not _decide(off, 256)[0]

    decode_only = StaticDiscovery(decode=[DECODE])
    assert _pipeline(decode_only).mode() == "disagg"
    assert _decide(_pipeline(decode_only), 256)[0]
    with pytest.raises(OpenAIError) as err:
        _pipeline(decode_only, disagg_prefill_fallback=False).mode()
    assert err.value.status_code == 503


def test_colocated_instances_go_before_the_prefill_fallback() -> None:
    discovery = StaticDiscovery(decode=[DECODE], both=["127.0.0.1:3"])
    assert _pipeline(discovery).mode() == "colocated"


def test_ready_with_local_prefill_only_when_no_prefill_instance_is_up() -> None:
    """A prefill instance not polled yet is not "down": /ready must not say the decode
    instances prefill while requests still go to it."""
    discovery = StaticDiscovery(prefill=[PREFILL], decode=[DECODE])
    pipeline = _pipeline(discovery)
    assert not pipeline.can_prefill_locally()  # nothing polled yet
    discovery.get(DECODE).alive = True
    assert not pipeline.can_prefill_locally()  # the prefill instance: not polled yet
    discovery.get(PREFILL).alive = False
    assert pipeline.can_prefill_locally()
    assert not _pipeline(discovery, disagg_prefill_fallback=False).can_prefill_locally()
