"""The KV cache budget of an engine process and the split of one GPU (issue 36).

Two engines on one GPU (``tandem up --device cuda``) each sized their cache from 90% of
the GPU's total memory. Now each takes ``gpu_memory_utilization`` of the TOTAL memory
less what its own process uses besides the cache (vLLM's rule), ``tandem up`` gives
each engine on a shared GPU its share, and an engine whose share is not free at start
is refused. Pure arithmetic: no GPU needed.
"""

from __future__ import annotations

import pytest

from tandem.engine.config import CacheConfig
from tandem.engine.kv_budget import (
    CPU_MAX_KV_CACHE_BYTES,
    MemorySnapshot,
    check_free_memory,
    cpu_kv_budget_bytes,
    cuda_kv_budget_bytes,
    unprofiled_prefill_bytes,
)
from tandem.kernels.attention_backend import PREFILL_SCORE_BUDGET_BYTES

GIB = 1 << 30
TOTAL = 80 * GIB


def _engine_budget(util: float, free_at_start: int, weights: int, activations: int,
                   non_torch: int) -> tuple[int, int]:
    """One engine's (KV budget, device memory in use after it allocated its cache),
    from a GPU with ``free_at_start`` free: it loads ``weights``, profiles a step of
    ``activations``, its libraries add ``non_torch`` outside torch's allocator."""
    start = MemorySnapshot(free_at_start, TOTAL, 0)
    check_free_memory(util, start, "cuda:0")
    after = MemorySnapshot(free_at_start - weights - non_torch, TOTAL, weights)
    budget = cuda_kv_budget_bytes(util, start, after, weights + activations)
    return budget, TOTAL - free_at_start + weights + non_torch + budget


def test_two_engines_on_one_gpu_each_take_their_share_of_the_total():
    """A prefill and a decode engine at 0.45 each, started one after the other: each
    budget is 0.45 of the total less its own weights, activations and non-torch memory,
    and together they stay within 0.9 of the GPU."""
    weights, act, lib = 16 * GIB, 2 * GIB, GIB // 2
    first, used = _engine_budget(0.45, TOTAL, weights, act, lib)
    assert first == int(0.45 * TOTAL) - weights - act - lib
    second, used = _engine_budget(0.45, TOTAL - used, weights, act, lib)
    assert second == first  # the first engine's memory is not charged to the second
    assert used + act <= 0.9 * TOTAL  # weights, libraries, caches and one step each


def test_the_default_share_on_a_gpu_already_in_use_is_refused_naming_the_flag():
    """The old rule gave a second engine 0.9 of the total too: 1.8 of the GPU together.
    Now the second engine at the default fraction is refused at start."""
    _, used = _engine_budget(0.9, TOTAL, 16 * GIB, 2 * GIB, GIB // 2)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: 0.9 of cuda:0"):
        _engine_budget(0.9, TOTAL - used, 16 * GIB, 2 * GIB, GIB // 2)


def test_memory_another_process_frees_or_takes_is_not_this_ones():
    """Non-torch memory is what the device's use rose by beyond torch's own reserve
    (clamped at 0: another process freeing memory meanwhile gives nothing back)."""
    start = MemorySnapshot(70 * GIB, TOTAL, GIB)
    grew = MemorySnapshot(60 * GIB, TOTAL, 10 * GIB)  # +10 GiB used, +9 GiB torch
    assert cuda_kv_budget_bytes(0.5, start, grew, 9 * GIB) == 40 * GIB - 9 * GIB - GIB
    shrank = MemorySnapshot(75 * GIB, TOTAL, 10 * GIB)
    assert cuda_kv_budget_bytes(0.5, start, shrank, 9 * GIB) == 31 * GIB
    assert cuda_kv_budget_bytes(0.1, start, grew, 9 * GIB, unprofiled_bytes=GIB) == 0


def test_the_largest_masked_prefill_is_charged_to_the_budget():
    """The profiling step runs unmasked prefills only; the worst chunk after a full
    cached context (a 2,048-token chunk at 32k, GQA 32/8) is tiled and its bounded
    temporaries are taken off the budget."""
    extra = unprofiled_prefill_bytes(device_type="cuda", num_heads=32, num_kv_heads=8,
                                     head_dim=128, elem_bytes=2, max_num_batched_tokens=2048,
                                     max_model_len=32768, flash=True)
    assert 2 * PREFILL_SCORE_BUDGET_BYTES <= extra < GIB
    start = after = MemorySnapshot(TOTAL, TOTAL, 0)
    assert cuda_kv_budget_bytes(0.9, start, after, 0, extra) == int(0.9 * TOTAL) - extra
    assert unprofiled_prefill_bytes(device_type="cuda", num_heads=4, num_kv_heads=2,
                                    head_dim=8, elem_bytes=4, max_num_batched_tokens=16,
                                    max_model_len=1, flash=False) == 0


def test_the_cpu_budget_is_capped():
    assert cpu_kv_budget_bytes(0.9, 100 * GIB, GIB) == CPU_MAX_KV_CACHE_BYTES
    assert cpu_kv_budget_bytes(0.5, 4 * GIB, GIB) == GIB
    assert cpu_kv_budget_bytes(0.5, GIB, GIB) == 0


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1, True, "0.5"])
def test_the_fraction_is_checked_naming_the_field(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        CacheConfig(gpu_memory_utilization=bad)


def test_the_runner_sizes_a_cuda_cache_by_the_rule(monkeypatch):
    """A CPU runner told it is on cuda:0, its CUDA memory counters faked: the profile
    runs, and the budget is the rule's (the fraction of the total less the torch peak,
    the non-torch growth and the largest masked prefill's temporaries)."""
    import contextlib

    import torch
    from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

    from tandem.engine.config import EngineConfig, ModelConfig, SchedulerConfig
    from tandem.engine.model_runner import ModelRunner

    hf = tiny_hf_model(tiny_config("LlamaForCausalLM", vocab=64, hidden=32, ffn=48, layers=1,
                                   max_len=64, special_tokens=False), std=0.2)
    config = EngineConfig(model=ModelConfig(dtype="float32", max_model_len=64),
                          cache=CacheConfig(block_size=4, gpu_memory_utilization=0.5),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=1000))
    runner = ModelRunner(config, as_loaded_model(hf, "tiny", 64))
    runner.cuda_index = 0
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    total = 8 * GIB
    runner._memory_at_start = MemorySnapshot(total, total, 0)
    profiled: list[int] = []
    real_profile = runner.profile_run
    monkeypatch.setattr(runner, "profile_run", lambda: profiled.append(1) or real_profile())
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    extra = unprofiled_prefill_bytes(device_type="cpu", num_heads=4, num_kv_heads=2,
                                      head_dim=8, elem_bytes=4, max_num_batched_tokens=32,
                                      max_model_len=64, flash=False)
    peak = total // 2 - extra - 100 - (1 << 20)  # leaves 1 MiB: below the max_num_seqs cap
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index: peak)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (total - peak - 100, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: peak)
    want = (1 << 20) // runner.block_bytes
    assert runner.determine_num_blocks() == want and profiled == [1]
    runner._memory_at_start = MemorySnapshot(total // 4, total, 0)
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.5 of cpu"):
        runner.determine_num_blocks()
