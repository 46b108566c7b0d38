"""Checks of what callers hand the store client: keys and block buffers.

Buffers become flat uint8 numpy views of the caller's memory (no copy), which
both readers and the put path move bytes into or out of.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore import protocol as proto
from tandem.kvstore.transport import address_of


def check_keys(keys: Sequence[BlockKey], layout: KVCacheLayout | None) -> list[BlockKey]:
    """``keys`` as a list, each checked (against ``layout``'s fingerprint if given).

    Raises:
        ValueError: not a BlockKey, another layout's key, or too many keys.
    """
    keys = list(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, BlockKey):
            raise ValueError(f"keys[{i}] must be a BlockKey, got {type(k).__name__}")
        if layout is not None and k.layout_fingerprint != layout.fingerprint:
            raise ValueError(
                f"keys[{i}] has layout fingerprint {k.layout_fingerprint.hex()}, this "
                f"client serves {layout.fingerprint.hex()} (another model or KV layout)"
            )
    if len(keys) > proto.MAX_BLOCKS_PER_REQUEST:
        raise ValueError(f"keys: at most {proto.MAX_BLOCKS_PER_REQUEST} blocks per call")
    return keys


def byte_views(blocks: Sequence[object], n: int, *, writable: bool, name: str,
               layout: KVCacheLayout | None) -> list[np.ndarray]:
    """Flat uint8 views (no copy) of ``n`` contiguous CPU buffers (tensors, arrays,
    memoryviews); ``name`` names the argument in errors; ``layout``, if given, fixes
    their size.

    Raises:
        ValueError: a count other than ``n``, a buffer that is empty, not
            contiguous, read-only where ``writable``, of another size than the
            layout's blocks, or (``writable``) overlapping another.
    """
    if len(blocks) != n:
        raise ValueError(f"{name} has {len(blocks)} buffers for {n} keys")
    views = [byte_view(b, writable=writable, name=f"{name}[{i}]") for i, b in enumerate(blocks)]
    if writable and len(views) > 1:
        # two blocks landing in one buffer would fail their checksums, and a
        # checksum failure removes the (intact) block from the shared index
        spans = sorted((address_of(v), v.nbytes, i) for i, v in enumerate(views))
        for (a0, n0, i0), (a1, _, i1) in zip(spans, spans[1:], strict=False):
            if a1 < a0 + n0:
                raise ValueError(f"{name}[{min(i0, i1)}] and {name}[{max(i0, i1)}] overlap: "
                                 "each block needs a buffer of its own")
    for i, v in enumerate(views):
        if v.nbytes == 0:
            raise ValueError(f"{name}[{i}] is empty")
        if layout is not None and v.nbytes != layout.block_bytes:
            raise ValueError(
                f"{name}[{i}] has {v.nbytes} bytes, the layout's blocks have "
                f"{layout.block_bytes} (wrong block size)"
            )
    return views


def byte_view(obj: object, *, writable: bool, name: str) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU buffer, without copying.

    Args:
        obj: torch tensor, numpy array, memoryview, bytes or bytearray.
        writable: the view will be written (a get's destination).
        name: the argument's name for error messages, e.g. ``"into[3]"``.

    Raises:
        ValueError: not contiguous, not on the CPU, or read-only when ``writable``.
    """
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        arr = obj if obj.ndim == 1 and obj.dtype == np.uint8 else obj.reshape(-1).view(np.uint8)
    elif (torch := sys.modules.get("torch")) is not None and isinstance(obj, torch.Tensor):
        # NOTE: a tensor can only come from an imported torch, hence sys.modules
        # rather than an import per call (the hot path runs this once per block)
        if obj.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got device {obj.device}")
        if not obj.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        # dtype view first: half the cost of reshape(-1).view(torch.uint8).numpy()
        return (obj if obj.dim() else obj.reshape(1)).view(torch.uint8).numpy().reshape(-1)
    else:
        try:
            arr = np.frombuffer(memoryview(obj), dtype=np.uint8)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a contiguous buffer: {exc}") from exc
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return arr
