"""When the Triton path is used.

Triton kernels run on CUDA tensors when the ``triton`` package is importable; the
torch references serve everything else. Tests run the Triton kernels on CPU
tensors through Triton's interpreter (``TRITON_INTERPRET=1``, which must be set
before the first kernel is built: kernels are built lazily, on first use).
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op on ``t`` takes the Triton path (CUDA tensor + Triton installed)."""
    return t.is_cuda and triton_available()
