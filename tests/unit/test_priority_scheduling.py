"""``--scheduling-policy priority`` end to end in one engine: the waiting queue orders by
(priority, arrival), a full batch (``max_num_seqs``) preempts its lowest-priority request
for a more urgent waiting one, and FCFS rejects a non-zero priority (as vLLM does)."""

from __future__ import annotations

import itertools

import pytest
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

from tandem.contracts.role import Role
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.llm import LLM
from tandem.engine.model_loader import LoadedModel
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.validation import RequestError
from tandem.services.common.server import build_engine_config, build_parser

VOCAB = 97
MAX_LEN = 64
_ids = itertools.count()


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=32, ffn=64, max_len=MAX_LEN,
                         special_tokens=False)
    return as_loaded_model(tiny_hf_model(config, std=0.3), "tiny-llama", MAX_LEN)


def make_core(loaded: LoadedModel, policy: str, max_num_seqs: int = 2) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=4, num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                                  policy=policy),  # type: ignore[arg-type]
    )
    return EngineCore(config, create_executor(config, loaded))


def make_request(name: str, priority: int, max_tokens: int = 6) -> Request:
    prompt = [1 + next(_ids) % 50, 2, 3, 4, 5]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(name, prompt, params, priority=priority)


def first_token_steps(core: EngineCore, limit: int = 100) -> dict[str, int]:
    """Step until idle; request id -> the first step (0-based, from this call) that gave
    it a token."""
    first: dict[str, int] = {}
    for step in range(limit):
        if not core.has_unfinished_requests():
            return first
        for out in core.step():
            if out.new_token_ids:
                first.setdefault(out.request_id, step)
    raise AssertionError(f"still busy after {limit} steps")


def test_urgent_request_behind_a_full_batch_starts_first_and_preempts(loaded) -> None:
    core = make_core(loaded, "priority", max_num_seqs=2)
    for name in ("run-a", "run-b"):
        core.add_request(make_request(name, priority=5))
    core.step()  # both running: the batch is full
    assert [r.request_id for r in core.scheduler.running] == ["run-a", "run-b"]
    for name in ("wait-c", "wait-d"):
        core.add_request(make_request(name, priority=5))
    core.add_request(make_request("urgent", priority=0))

    outs = core.step()
    # The urgent request runs in the very next step, taking the seat of the running
    # request that sorts last (same priority: the later arrival, run-b).
    assert {o.request_id for o in outs if o.new_token_ids} == {"run-a", "urgent"}
    assert core.scheduler.num_preemptions == 1
    assert core.scheduler.requests["run-b"].status == RequestStatus.PREEMPTED
    # The preempted request resumes first, then the waiting ones in arrival order.
    resumed = first_token_steps(core)
    assert resumed["run-b"] < resumed["wait-c"] < resumed["wait-d"]


def test_equal_or_lower_priority_never_preempts(loaded) -> None:
    core = make_core(loaded, "priority", max_num_seqs=2)
    for name in ("run-a", "run-b"):
        core.add_request(make_request(name, priority=1))
    core.step()
    core.add_request(make_request("same", priority=1))
    core.add_request(make_request("later", priority=3))
    outs = core.step()
    assert {o.request_id for o in outs if o.new_token_ids} == {"run-a", "run-b"}
    assert core.scheduler.num_preemptions == 0


def test_waiting_queue_admits_lowest_priority_value_first(loaded) -> None:
    core = make_core(loaded, "priority", max_num_seqs=1)
    for name, prio in (("p3", 3), ("p1", 1), ("p2", 2), ("p1-late", 1)):
        core.add_request(make_request(name, prio, max_tokens=2))
    steps = first_token_steps(core)
    assert sorted(steps, key=steps.__getitem__) == ["p1", "p1-late", "p2", "p3"]


def test_fcfs_runs_in_arrival_order_and_never_preempts_for_seats(loaded) -> None:
    core = make_core(loaded, "fcfs", max_num_seqs=2)
    for name in ("a", "b"):
        core.add_request(make_request(name, priority=0))
    core.step()
    core.add_request(make_request("c", priority=0))
    outs = core.step()
    assert {o.request_id for o in outs if o.new_token_ids} == {"a", "b"}
    assert core.scheduler.num_preemptions == 0


def test_fcfs_rejects_non_zero_priority(loaded) -> None:
    core = make_core(loaded, "fcfs")
    with pytest.raises(RequestError, match="priority") as info:
        core.add_request(make_request("x", priority=2))
    assert info.value.field == "priority"
    assert not core.has_unfinished_requests()


def test_llm_rejects_unknown_policy_naming_the_field() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(scheduling_policy="lifo")


def test_flag_reaches_the_scheduler_config() -> None:
    parser = build_parser("tandem prefill", Role.PREFILL)
    ns = parser.parse_args(["--scheduling-policy", "priority", "--redis-url", "redis://x"])
    assert build_engine_config(ns, "prefill").scheduler.policy == "priority"
    ns = parser.parse_args(["--redis-url", "redis://x"])
    assert build_engine_config(ns, "prefill").scheduler.policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
