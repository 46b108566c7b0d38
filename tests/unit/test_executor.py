"""The executor seam: EngineCore driven through the ``Executor`` interface alone.

A fake executor (no model) records every call, so these tests pin the
order the core calls the interface in, that the model's facts and the KV cache size
reach the core and the scheduler only through it, and the config's backend choice.
The uni executor against the model runner is in tests/e2e/test_model_runner.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import Executor, create_executor
from tandem.engine.model_facts import ModelFacts
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
_ids = itertools.count()


def make_facts(**over: Any) -> ModelFacts:
    fields: dict[str, Any] = dict(
        model_id="fake",
        vocab_size=50,
        max_model_len=32,
        eos_token_id=7,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        device="cpu",
    )
    fields.update(over)
    return ModelFacts(**fields)


class FakeExecutor(Executor):
    """Implements only the interface: samples ``script``'s tokens (then 1) for each
    request at the end of its known tokens, and records every call in ``calls``."""

    def __init__(self, facts: ModelFacts, num_blocks: int, script: dict[str, list[int]]):
        self._facts = facts
        self._num_blocks = num_blocks
        self._script = {rid: iter(toks) for rid, toks in script.items()}
        self.calls: list[tuple[str, Any]] = []
        self.steps: list[dict[str, int]] = []

    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    @property
    def tokenizer(self) -> Any:
        return None

    def determine_num_blocks(self) -> int:
        self.calls.append(("determine_num_blocks", None))
        return self._num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.calls.append(("initialize_kv_cache", num_blocks))

    def register_kv_caches(self, connector_worker: Any) -> None:
        self.calls.append(("register_kv_caches", connector_worker))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert not scheduler_output.is_empty, "the core must skip empty steps"
        self.calls.append(("execute_model", None))
        self.steps.append(dict(scheduler_output.num_scheduled_tokens))
        out = ModelRunnerOutput()
        for req in scheduler_output.scheduled_requests:
            n = scheduler_output.num_scheduled_tokens[req.request_id]
            if req.num_computed_tokens + n == req.num_tokens:
                it = self._script.get(req.request_id)
                out.sampled_token_ids[req.request_id] = next(it, 1) if it else 1
        return out

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))


def make_config(**cache: Any) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, **cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4),
    )


def make_request(prompt: list[int], **params: Any) -> Request:
    params.setdefault("temperature", 0.0)
    return Request(f"r{next(_ids)}", prompt, SamplingParams(**params))


def run(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def test_core_sizes_the_cache_through_the_executor_and_schedules_on_it() -> None:
    """The executor's block count is the scheduler's pool; no connector: no registration."""
    fake = FakeExecutor(make_facts(), num_blocks=6, script={})
    core = EngineCore(make_config(), fake)
    assert fake.calls == [("determine_num_blocks", None), ("initialize_kv_cache", 6)]
    assert core.num_blocks == 6 and core.get_stats().num_total_blocks == 6
    assert core.model_facts is fake.model_facts and core.tokenizer is None


def test_core_steps_through_the_executor_with_its_facts() -> None:
    """Chunked prefill and decode reach the executor as SchedulerOutputs; its sampled
    tokens come back as outputs; the facts' EOS id stops a request and their vocabulary
    bounds the prompt."""
    facts = make_facts(eos_token_id=7, vocab_size=50)
    a = make_request(list(range(10, 20)), max_tokens=5)  # 10 tokens: two chunks of 8 + 2
    b = make_request([3, 4], max_tokens=5)
    fake = FakeExecutor(facts, num_blocks=16, script={a.request_id: [11, 12], b.request_id: [7]})
    core = EngineCore(make_config(), fake)
    with pytest.raises(ValueError, match=r"token id 50 outside \[0, 50\)"):
        core.add_request(make_request([1, 50]))
    core.add_request(a)
    core.add_request(b)
    tokens = run(core)
    assert tokens == {a.request_id: [11, 12, 1, 1, 1], b.request_id: [7]}
    assert b.get_finish_reason() == "stop" and a.get_finish_reason() == "length"
    assert fake.steps[0] == {a.request_id: 8}  # the step budget, a's first chunk
    assert fake.steps[1] == {a.request_id: 2, b.request_id: 2}
    assert all(n == 1 for step in fake.steps[3:] for n in step.values())
    assert core.num_steps == len(fake.steps)
    core.shutdown()
    assert fake.calls[-1] == ("shutdown", None)
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_max_tokens_default_comes_from_the_facts() -> None:
    fake = FakeExecutor(make_facts(max_model_len=12), num_blocks=16, script={})
    core = EngineCore(make_config(), fake)
    req = make_request([1, 2, 3], max_tokens=None)
    core.add_request(req)
    assert len(run(core)[req.request_id]) == 12 - 3


def test_the_executor_budget_below_one_block_is_the_executors_error() -> None:
    class NoMemory(FakeExecutor):
        def determine_num_blocks(self) -> int:
            raise ValueError("kv_cache_memory_bytes: the KV cache budget holds no block")

    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineCore(make_config(), NoMemory(make_facts(), 1, {}))


def test_parallel_config_picks_and_checks_the_backend() -> None:
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(pipeline_parallel_size=2).world_size == 2
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of uni, mp"):
        ParallelConfig(distributed_executor_backend="ray")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
            ParallelConfig(**{name: 0})


def test_speculative_decoding_with_several_workers_is_refused() -> None:
    from tandem.engine.config import EngineConfig, SpeculativeConfig

    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2), speculative=spec)


def test_model_facts_reject_counts_below_one() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        make_facts(vocab_size=0)
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1"):
        make_facts(num_kv_heads=0)


def test_create_executor_bad_model_path_is_a_value_error(tmp_path) -> None:
    """The factory loads through the worker: a missing model is the loader's ValueError."""
    config = EngineConfig(model=ModelConfig(model=str(tmp_path / "missing"), dtype="float32"))
    with pytest.raises(ValueError):
        create_executor(config)


def test_workers_get_disjoint_cpu_sets() -> None:
    from tandem.engine.executor.multiproc import split_cpus

    assert split_cpus([0, 1], 2) == [(0,), (1,)]
    assert split_cpus([4, 5, 6, 7, 8], 2) == [(4, 5, 6), (7, 8)]
    assert split_cpus([3], 1) == [(3,)]
    with pytest.raises(ValueError, match="= 3 workers exceed the 2 CPUs"):
        split_cpus([0, 1], 3)
