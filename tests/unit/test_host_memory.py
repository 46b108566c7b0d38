"""Huge-page-backed host tensors (kernels/host_memory.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from tandem.kernels.cache import allocate_kv_cache
from tandem.kernels.host_memory import HUGE_PAGE_BYTES, MIN_BYTES, empty_huge_page_tensor


def _vma_fields(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``addr``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_large_tensor_is_zeroed_aligned_and_writable() -> None:
    t = empty_huge_page_tensor((3, MIN_BYTES // 4), torch.bfloat16)
    assert t.shape == (3, MIN_BYTES // 4) and t.dtype == torch.bfloat16
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[1, 7] = 2.5
    assert float(t.sum()) == 2.5


def test_small_tensor_is_a_plain_zeroed_tensor() -> None:
    t = empty_huge_page_tensor((4, 5), torch.float32)
    assert t.shape == (4, 5) and not t.any()


def test_negative_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        empty_huge_page_tensor((2, -1), torch.float32)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="THP is Linux's")
def test_kv_cache_mapping_is_eligible_for_huge_pages() -> None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are disabled on this host")
    kv = allocate_kv_cache(256, 4, 16, 2, 64, torch.bfloat16)  # 8 MiB
    assert not kv.any()
    fields = _vma_fields(kv.data_ptr())
    if "THPeligible" not in fields:
        pytest.skip("this kernel's smaps does not report THPeligible")
    assert fields["THPeligible"] == "1", fields
