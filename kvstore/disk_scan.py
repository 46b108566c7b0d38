"""A store node's disk directory at start-up: checked for writes and room, and scanned for
the block files a previous run left (kvstore/disk_file.py), each verified. Blocking: the
node runs :func:`scan_directory` in a thread before it registers anything."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tandem.kvstore import disk_file as df

logger = logging.getLogger("tandem.kvstore.server")


def probe_directory(path: Path, capacity_bytes: int, flag_prefix: str = "--") -> None:
    """Create ``path`` if needed and check that blocks can be written there and that
    ``capacity_bytes`` fit (free space plus the block files already there).
    ``flag_prefix`` (``--kvstore-`` under `tandem up`) names the flags in the errors.

    Raises:
        ValueError: a capacity below 1 byte, or ``path`` not creatable, not writable or
            without the room, naming the flag.
    """
    if capacity_bytes < 1:
        raise ValueError(f"{flag_prefix}disk-capacity must be >= 1, got {capacity_bytes}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{uuid.uuid4().hex}{df.TMP_SUFFIX}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        free = shutil.disk_usage(path).free
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(
            f"{flag_prefix}disk-path {path} is not a writable directory: {reason}"
        ) from exc
    held = sum(p.stat().st_size for p in path.glob(f"*/*{df.SUFFIX}"))
    if free + held < capacity_bytes:
        raise ValueError(
            f"{flag_prefix}disk-path {path} has {free + held} bytes of room (free + block files "
            f"already there), less than {flag_prefix}disk-capacity {capacity_bytes}"
        )


@dataclass
class ScanResult:
    """What a directory holds.

    Attributes:
        blocks: valid block files as (header, file bytes), oldest first (by mtime).
        corrupt: reason -> files dropped (truncated, checksum, header, unreadable).
        num_temp_removed: leftover temporary files (writes cut by a crash) removed.
    """

    blocks: list[tuple[df.BlockHeader, int]] = field(default_factory=list)
    corrupt: dict[str, int] = field(default_factory=dict)
    num_temp_removed: int = 0


def scan_directory(root: Path) -> ScanResult:
    """Verify every block file under ``root``; remove the bad ones and leftover
    temporary files (a block file whose check fails is dropped and counted, never
    served)."""
    out = ScanResult()
    for tmp in root.glob(f"*/*{df.TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)
        out.num_temp_removed += 1
    found: list[tuple[float, df.BlockHeader, int]] = []
    for path in root.glob(f"*/*{df.SUFFIX}"):
        try:
            mtime = path.stat().st_mtime
            header, size = df.verify_file(path)
        except df.BlockFileError as exc:
            logger.warning("disk tier: %s; dropped", exc)
            out.corrupt[exc.reason] = out.corrupt.get(exc.reason, 0) + 1
            path.unlink(missing_ok=True)
            continue
        except OSError as exc:
            logger.warning("disk tier: %s unreadable (%s); dropped", path, exc)
            out.corrupt["unreadable"] = out.corrupt.get("unreadable", 0) + 1
            path.unlink(missing_ok=True)
            continue
        found.append((mtime, header, size))
    found.sort(key=lambda x: x[0])
    out.blocks = [(h, n) for _, h, n in found]
    return out
