"""The KV store's disk tier in `tandem bench serve --launch` runs (``--launch-kvstore-tiers``).

Each launched stack runs once per entry of ``--launch-kvstore-tiers`` (``ram``: the store
node keeps blocks in host RAM only; ``disk``: with a disk tier under
``--launch-kvstore-disk-path``, a fresh folder per run), with the store's RAM set by
``--launch-kvstore-capacity``: a multi-turn run whose history outgrows that RAM shows
what the disk tier gives the later turns. After each run the store node's per-tier
counters are read from its ``/metrics`` (``kvstore`` field of the result), and after a
disk run the device under the folder is measured in the same run, ``dd``-style: one
file written, then read sequentially with ``O_DIRECT`` (the device, past the page cache)
and buffered (what a read of a file just written gets), next to the store's own disk
reads (payload bytes over the time its read threads spent, so per read thread).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

#: bytes of the dd-style probe file
PROBE_BYTES = 256 << 20
_CHUNK = 4 << 20


def check_args(args: argparse.Namespace) -> None:
    """Raises: ValueError naming the flag when the tier flags do not go together."""
    tiers = args.launch_kvstore_tiers
    if tiers and not args.launch:
        raise ValueError("--launch-kvstore-tiers: needs --launch (the bench starts the stacks)")
    if "disk" in tiers and not (
        args.launch_kvstore_disk_path and args.launch_kvstore_disk_capacity
    ):
        raise ValueError(
            "--launch-kvstore-tiers disk: needs --launch-kvstore-disk-path and "
            "--launch-kvstore-disk-capacity"
        )


def stack_fields(args: argparse.Namespace, tier: str, run: int) -> dict[str, Any]:
    """``StackConfig`` fields of one run's store node (a fresh disk folder per disk run)."""
    out: dict[str, Any] = {}
    if args.launch_kvstore_capacity:
        out["kvstore_capacity_bytes"] = args.launch_kvstore_capacity
    if tier == "disk":
        folder = Path(args.launch_kvstore_disk_path) / f"run-{run}"
        shutil.rmtree(folder, ignore_errors=True)
        out["kvstore_disk_path"] = str(folder)
        out["kvstore_disk_capacity_bytes"] = args.launch_kvstore_disk_capacity
    return out


def store_counters(metrics_url: str) -> dict[str, float]:
    """The store node's per-tier counters (blocks, bytes, hits, evictions, disk reads and
    writes) from its ``/metrics``."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("tandem:kvstore_"):
            continue
        for s in fam.samples:
            name = s.name.removeprefix("tandem:kvstore_")
            if "tier" in s.labels:
                name = f"{name}{{{s.labels['tier']}}}"
            elif s.labels and not name.endswith("_bucket"):
                name = f"{name}{{{','.join(s.labels.values())}}}"
            if not name.endswith("_bucket") and not name.endswith("_created"):
                out[name] = float(s.value)
    reads = out.get("disk_read_latency_seconds_sum", 0.0)
    if reads:
        out["disk_read_bytes_per_s"] = out.get("disk_read_bytes_total", 0.0) / reads
    return out


def sequential_read(folder: Path, size_bytes: int = PROBE_BYTES) -> dict[str, float]:
    """Write one file of ``size_bytes`` under ``folder`` (fsynced), read it back in 4 MiB
    sequential reads with ``O_DIRECT`` and then buffered; bytes per second of each
    (``direct`` is 0 where the file system refuses ``O_DIRECT``). The file is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "seq-read-probe.bin"
    buf = mmap.mmap(-1, _CHUNK)  # page aligned, as O_DIRECT needs
    buf.write(os.urandom(_CHUNK))
    try:
        with open(path, "wb") as f:
            for _ in range(size_bytes // _CHUNK):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        out = {"probe_bytes": float(size_bytes // _CHUNK * _CHUNK)}
        for name, flags in (("direct", os.O_DIRECT), ("buffered", 0)):
            try:
                fd = os.open(path, os.O_RDONLY | flags)
            except OSError:
                out[f"{name}_bytes_per_s"] = 0.0
                continue
            try:
                t0 = time.perf_counter()
                n = 0
                while (got := os.readv(fd, [buf])) > 0:
                    n += got
                out[f"{name}_bytes_per_s"] = n / (time.perf_counter() - t0)
            finally:
                os.close(fd)
        return out
    finally:
        path.unlink(missing_ok=True)
        buf.close()


def report(
    results: list[dict[str, Any]], label: str, metrics_url: str, disk_path: str | None
) -> None:
    """Read the store node's counters (and, for a disk run, measure the device's
    sequential read under ``disk_path``), print them and add them to each of the run's
    ``results`` (``kvstore``, ``device_sequential_read``)."""
    counters = store_counters(metrics_url)
    seq = sequential_read(Path(disk_path)) if disk_path else None
    print_report(label, counters, seq)
    for m in results:
        m["kvstore"] = counters
        if seq is not None:
            m["device_sequential_read"] = seq


def print_report(label: str, counters: dict[str, float], seq: dict[str, float] | None) -> None:
    """One run's store figures."""
    mib = 1 << 20
    print(
        f"KV store ({label}): RAM hits {counters.get('tier_hits_total{ram}', 0):.0f}, "
        f"disk hits {counters.get('tier_hits_total{disk}', 0):.0f}, evictions "
        f"{counters.get('evictions_total', 0):.0f}, disk blocks "
        f"{counters.get('tier_blocks{disk}', 0):.0f}",
        flush=True,
    )
    if seq is not None:
        print(
            f"  disk reads {counters.get('disk_read_bytes_total', 0) / mib:.0f} MiB at "
            f"{counters.get('disk_read_bytes_per_s', 0) / mib:.0f} MiB/s per read thread; "
            f"device sequential read {seq['direct_bytes_per_s'] / mib:.0f} MiB/s (O_DIRECT), "
            f"{seq['buffered_bytes_per_s'] / mib:.0f} MiB/s (buffered)",
            flush=True,
        )
