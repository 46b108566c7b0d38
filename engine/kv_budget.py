"""How many bytes the KV cache of one engine process may take (vLLM's memory profile).

CUDA, vLLM's rule: the process may use ``gpu_memory_utilization`` of the device's TOTAL
memory; the KV cache gets what that leaves after this process's own non-KV use::

    kv_budget = gpu_memory_utilization * total
                - torch peak allocated (weights + the profiled step's activations)
                - non-torch memory this process added since it started (CUDA graphs'
                  and libraries' allocations outside torch's allocator: the rise of
                  device-wide used memory minus the rise of torch's reserved memory)
                - the attention workspace of the largest masked prefill, which the
                  profiling step does not run (``unprofiled_prefill_bytes``)

so two engines that share a GPU each stay within their own fraction (``tandem up``
gives each its share; ``split_gpu_memory_utilization``). Memory that other processes
use is not charged to this one; instead an engine whose fraction is not free when it
starts is refused (``check_free_memory``), as vLLM refuses it, rather than running out
of memory later.

CPU: host memory has no peak counter and a profiling step of 2,048 tokens costs seconds,
so the activations are estimated (``activation_bytes_estimate``) and subtracted from
the fraction of the memory available now, capped at ``CPU_MAX_KV_CACHE_BYTES``.

The arithmetic is pure and unit-tested on the CPU; only ``take_snapshot`` and
``available_memory_bytes`` read the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from tandem.kernels.attention_backend import plan_prefill_attention

#: NOTE: on CPU the KV cache shares RAM with everything else on the box (several
#: services may run on one laptop), so the profiled budget is capped like vLLM's CPU
#: backend does (VLLM_CPU_KVCACHE_SPACE, 4 GiB by default).
CPU_MAX_KV_CACHE_BYTES = 4 << 30


@dataclass(frozen=True)
class MemorySnapshot:
    """One CUDA device's memory as this process sees it at one moment, in bytes.

    Attributes:
        free / total: ``torch.cuda.mem_get_info`` (device-wide: every process).
        torch_reserved: what this process's torch caching allocator holds.
    """

    free: int
    total: int
    torch_reserved: int

    @property
    def used(self) -> int:
        """Device memory in use by every process, bytes."""
        return self.total - self.free


def take_snapshot(device_index: int) -> MemorySnapshot:
    """The memory of CUDA device ``device_index`` now (after returning torch's cached
    free blocks, so that reserved memory is memory in use)."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device_index)
    return MemorySnapshot(int(free), int(total), int(torch.cuda.memory_reserved(device_index)))


def check_free_memory(utilization: float, at_start: MemorySnapshot, device: str) -> None:
    """Refuse an engine whose share of the device is not free when it starts (vLLM's
    check): it would otherwise size its cache from memory another process holds.

    Raises:
        ValueError: naming ``gpu_memory_utilization``, when ``at_start.free`` is below
            ``utilization * at_start.total``.
    """
    wanted = utilization * at_start.total
    if at_start.free < wanted:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization: {utilization} of {device}'s {at_start.total / gib:.1f} "
            f"GiB is {wanted / gib:.1f} GiB, but only {at_start.free / gib:.1f} GiB is free "
            "at start (other processes hold the rest): lower gpu_memory_utilization so that "
            "the fractions of the processes sharing the GPU add up to at most the free memory"
        )


def cuda_kv_budget_bytes(
    utilization: float,
    at_start: MemorySnapshot,
    after_profile: MemorySnapshot,
    torch_peak_bytes: int,
    unprofiled_bytes: int = 0,
) -> int:
    """The KV cache budget of one CUDA engine process, bytes (vLLM's rule, see the
    module docstring).

    Args:
        utilization: the process's fraction of the device's total memory, in (0, 1].
        at_start: the device before this process loaded its weights.
        after_profile: the device after the profiling step (torch's cache emptied).
        torch_peak_bytes: torch's peak allocated bytes over the profiling step (the
            weights included, being allocated).
        unprofiled_bytes: temporaries of steps worse than the profiled one.

    Returns:
        The budget, >= 0.
    """
    non_torch = max(0, (after_profile.used - at_start.used)
                    - (after_profile.torch_reserved - at_start.torch_reserved))
    non_kv = torch_peak_bytes + non_torch + unprofiled_bytes
    return max(0, int(utilization * after_profile.total) - non_kv)


def cpu_kv_budget_bytes(utilization: float, available_bytes: int, activation_bytes: int) -> int:
    """The KV cache budget of a CPU engine: ``utilization`` of the host memory
    available now less the estimated activations, capped at ``CPU_MAX_KV_CACHE_BYTES``;
    bytes, >= 0."""
    budget = available_bytes * utilization - activation_bytes
    return int(max(0, min(budget, CPU_MAX_KV_CACHE_BYTES)))


def available_memory_bytes() -> int:
    """Host memory available to new allocations, in bytes."""
    return int(psutil.virtual_memory().available)


def activation_bytes_estimate(
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    elem_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    vocab_size: int,
) -> int:
    """Upper estimate of one step's live activations at the maximum batch, in bytes.

    Per token: the residual stream and norm output, the fused QKV output, the
    attention output and the fused gate/up plus SiLU product (this rank's heads
    and MLP slice), doubled for temporaries; plus float32 logits of
    ``max_num_seqs`` rows (twice, for the sampler's copies).
    """
    qkv = (num_heads + 2 * num_kv_heads) * head_dim
    per_token = (4 * hidden_size + qkv + 3 * intermediate_size) * elem_bytes * 2
    logits = max_num_seqs * vocab_size * 4 * 2
    return max_num_batched_tokens * per_token + logits


def unprofiled_prefill_bytes(
    *,
    device_type: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    flash: bool,
) -> int:
    """The attention temporaries of the worst prefill a step can hold that the
    profiling step does not run, bytes: the largest chunk (``max_num_batched_tokens``
    tokens) after a cached prefix that fills the context (``max_model_len`` keys), a
    masked prefill (``kernels.attention_backend.plan_prefill_attention``'s
    ``peak_bytes``). 0 where no prefill can have a prefix (``max_model_len`` < 2).
    """
    if max_model_len < 2:
        return 0
    chunk = min(max_num_batched_tokens, max_model_len - 1)
    plan = plan_prefill_attention(device_type, num_heads, num_kv_heads, head_dim, elem_bytes,
                                  chunk, max_model_len, masked=True, flash=flash)
    return plan.peak_bytes
