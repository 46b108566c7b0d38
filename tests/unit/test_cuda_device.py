"""An engine on any CUDA device makes that device current for its work (issue 36).

Only the distributed path called ``torch.cuda.set_device``: an engine on ``cuda:1``
stepped from any other thread launched its Triton kernels and captured its CUDA graphs
on device 0 with device 1's pointers. The model runner now runs its load, profile, cache
allocation (and graph capture) and every step with its own device current, from any
thread. No GPU here: ``torch.cuda.device`` (the one call that switches) is replaced by a
per-thread fake, and the runner is a real CPU runner told its device is ``cuda:1``.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

from tandem.engine import model_runner as model_runner_mod
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig
from tandem.engine.cuda_device import cuda_device_index, on_device, runs_on_own_device
from tandem.engine.model_runner import ModelRunner
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import SchedulerOutput


@pytest.mark.parametrize("device,current,count,index", [
    ("cpu", 0, 0, None),
    ("cuda", 0, 2, 0),
    ("cuda", 1, 2, 1),  # a bare "cuda" is the caller's current device, as in torch
    ("cuda:1", 0, 2, 1),
    ("cuda:0", 1, 2, 0),
])
def test_the_device_index_of_an_engine(device, current, count, index):
    assert cuda_device_index(device, current, count) == index


@pytest.mark.parametrize("device,count,match", [
    ("cuda:2", 2, r"device 'cuda:2'.*does not exist.*cuda:0..cuda:1"),
    ("cuda", 0, "no CUDA device"),
    ("tpu:0", 1, "is not a device"),
])
def test_a_device_that_is_not_there_is_refused_naming_it(device, count, match):
    with pytest.raises(ValueError, match=match):
        cuda_device_index(device, 0, count)


class FakeCuda:
    """``torch.cuda.device`` for a machine without CUDA: a per-thread current device
    that starts at 0 in every thread, as CUDA's does."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> int:
        return getattr(self._local, "device", 0)

    @contextmanager
    def device(self, index: int):
        before = self.current()
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = before


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


def test_on_device_switches_and_restores(fake_cuda):
    with on_device(1):
        assert fake_cuda.current() == 1
        with on_device(None):  # the CPU: nothing changes
            assert fake_cuda.current() == 1
    assert fake_cuda.current() == 0


def test_a_decorated_method_runs_on_its_device_from_any_thread(fake_cuda):
    class Engine:
        cuda_index = 1

        @runs_on_own_device
        def step(self) -> int:
            return fake_cuda.current()

    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(Engine().step()))
    thread.start()
    thread.join()
    assert seen == [1] and Engine().step() == 1 and fake_cuda.current() == 0


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model(tiny_config("LlamaForCausalLM", vocab=64, hidden=32, ffn=48,
                                   layers=1, max_len=64, special_tokens=False), std=0.2)
    return as_loaded_model(hf, "tiny", 64)


def _step(req: Request, n: int) -> SchedulerOutput:
    return SchedulerOutput(scheduled_requests=[req], num_scheduled_tokens={req.request_id: n},
                           block_tables={req.request_id: [0, 1, 2, 3]})


def test_the_runner_loads_profiles_allocates_and_steps_on_its_device(tiny, fake_cuda,
                                                                      monkeypatch):
    """Every GPU-touching call of a runner on cuda:1 sees device 1 current, stepped from
    the constructing thread and from another one (a service's engine thread), while the
    caller's own current device stays 0."""
    config = EngineConfig(model=ModelConfig(dtype="float32", max_model_len=64),
                          cache=CacheConfig(block_size=4, num_blocks_override=8))
    runner = ModelRunner(config, tiny)
    runner.cuda_index = 1  # the CPU runner, told it lives on cuda:1
    seen: dict[str, int] = {}
    real_forward = runner._forward

    def forward(*args, **kwargs):
        seen.setdefault(threading.current_thread().name, fake_cuda.current())
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(runner, "_forward", forward)
    real_allocate = runner._allocate_kv_cache

    def allocate(*args):
        seen.setdefault("allocate", fake_cuda.current())
        return real_allocate(*args)

    monkeypatch.setattr(runner, "_allocate_kv_cache", allocate)
    runner.profile_run()
    assert seen.pop(threading.current_thread().name) == 1 and seen.pop("allocate") == 1
    runner.initialize_kv_cache(runner.determine_num_blocks())
    assert seen.pop("allocate") == 1
    req = Request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=2))
    out = []
    thread = threading.Thread(name="engine-loop",
                              target=lambda: out.append(runner.execute_model(_step(req, 5))))
    thread.start()
    thread.join()
    assert seen == {"engine-loop": 1}
    assert list(out[0].sampled_token_ids) == ["r"]
    assert fake_cuda.current() == 0


def test_the_model_loads_with_the_engines_device_current(tiny, fake_cuda, monkeypatch):
    """The weights load (``load_model``) and the memory baseline is read on the engine's
    device, not on whatever device the constructing thread had."""
    seen: list[tuple[str, int]] = []

    def load(model_config):
        seen.append(("load", fake_cuda.current()))
        return tiny

    monkeypatch.setattr(model_runner_mod, "resolve_cuda_index", lambda device: 1)
    monkeypatch.setattr(model_runner_mod, "load_model", load)
    monkeypatch.setattr(model_runner_mod.kv_budget, "take_snapshot",
                        lambda index: seen.append(("snapshot", index, fake_cuda.current())))
    config = EngineConfig(model=ModelConfig(dtype="float32", device="cuda:1", max_model_len=64))
    runner = ModelRunner(config)
    assert seen == [("snapshot", 1, 1), ("load", 1)]
    assert runner.cuda_index == 1 and runner.device == torch.device("cuda", 1)
    assert fake_cuda.current() == 0
