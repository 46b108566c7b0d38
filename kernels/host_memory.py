"""Host tensors backed by transparent huge pages (Linux THP), for the CPU path.

Why: a decode step streams the whole KV cache and the weights through the CPU,
from blocks scattered over the pool. With 4 KiB pages that is one TLB miss and
page walk per page touched; over a cache in 2 MiB pages the native decode
attention runs measurably faster (docs/benchmarks.md).

Where the kernel runs THP in ``madvise`` mode (the usual default), memory must
be marked before it is first touched, and a 2 MiB page needs a 2 MiB-aligned
range; torch's allocator gives neither guarantee, so these tensors live in
their own anonymous mapping. Where THP is off or unavailable the mapping is an
ordinary one (same contents, same speed as before).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Below this a huge page would mostly be padding.
MIN_BYTES = 4 << 20


def empty_huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of ``shape`` and ``dtype`` in its own mapping,
    2 MiB-aligned and advised for transparent huge pages (``MADV_HUGEPAGE``).

    Small tensors (under 4 MiB) or platforms without ``madvise`` get a plain
    ``torch.zeros``. The mapping is released with the last tensor viewing it.

    Raises:
        ValueError: on a negative dimension.
    """
    if any(d < 0 for d in shape):
        raise ValueError(f"shape must be non-negative, got {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # private: THP covers private anonymous memory (shared memory is shmem's
    # setting, usually off); anonymous mappings come zero-filled
    region = mmap.mmap(
        -1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = (-addr) % HUGE_PAGE_BYTES
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # THP compiled out: an ordinary mapping still works
        logger.debug("MADV_HUGEPAGE refused (%s)", exc)
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    # Fault every page in now (as torch.zeros would): a huge page's first touch
    # may compact memory, which must not happen inside a decode step.
    flat.zero_()
    return flat.view(dtype).view(shape)
