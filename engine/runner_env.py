"""What the model runner sets up once per process: the C heap's behaviour and the
warning of what keeps deterministic mode from holding for the loaded model."""

from __future__ import annotations

import ctypes
import logging

import torch

from tandem.kernels.linear import batch_variant_layers

__all__ = ["tune_glibc_malloc", "warn_batch_variant"]

logger = logging.getLogger(__name__)


def tune_glibc_malloc() -> bool:
    """Keep freed memory in the process instead of returning it to the OS.

    NOTE: every step allocates and frees activations of 1-30 MiB per op. With
    glibc's defaults such blocks are mmap'd / trimmed on free, so each new one
    page-faults on first write, which made the decode KV gather and a whole decode
    step several times slower on small VMs (docs/benchmarks.md). Raising the mmap and trim thresholds makes the heap act as
    a caching allocator (as PyTorch's CUDA allocator does). Process-wide and
    idempotent; a no-op (False) where glibc's ``mallopt`` is unavailable.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1 or libc.mallopt(m_mmap_threshold, 32 << 20)
    ok = libc.mallopt(m_trim_threshold, 1 << 30) == 1 and bool(ok)
    libc.mallopt(m_top_pad, 64 << 20)
    return ok


def warn_batch_variant(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Log (warning) what keeps ``ModelConfig.deterministic`` from holding for this
    model here: a dtype other than bfloat16 (float32 linears stay on torch's GEMM),
    or linear layers that our packed kernel does not serve (``batch_variant_layers``:
    a shape it does not take, or no native kernels on this machine). Returns the
    layer names."""
    names = batch_variant_layers(model)
    if dtype != torch.bfloat16:
        logger.warning(
            "deterministic: batch-invariant linears exist for bfloat16 only; in %s the "
            "linears run torch's GEMM, whose result for a row may depend on the batch",
            str(dtype).removeprefix("torch."),
        )
    elif names:
        logger.warning(
            "deterministic: %d linear layers have no packed kernel here (%s%s) and run "
            "torch's GEMM, whose result for a row may depend on the batch",
            len(names), ", ".join(names[:4]), ", ..." if len(names) > 4 else "",
        )
    return names
