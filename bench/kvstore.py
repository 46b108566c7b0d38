"""`tandem bench kvstore`: KV store put/get bandwidth and latency between processes.

Starts a private redis-server and one `tandem kvstore` node in a subprocess on
this host (or uses ``--redis-url`` with nodes already running), then for each
batch size puts fresh blocks and gets them back through the real client
(checksums included), and copies the same bytes in-process with numpy for
reference (in a warm loop of its own: see ``_memcpy_times``). Blocks are
consecutive rows of one cache array, as the engine's ``kv_cache[b]`` for
consecutive block ids. Figures are medians over the iterations.

The node runs on this host, so gets read its shared-memory pool (kvstore/shm.py)
unless ``--get-path ucx`` (or ``--no-shm``, or ``TANDEM_KV_SHM=0``); ``--get-path
both`` also times the UCX path on the same blocks (``get_ucx_*`` fields). Each
record's ``get_path`` says which path its gets took.

    tandem bench kvstore [--sizes 64K,256K,1M,4M,16M,64M] [--block-bytes 256K]
                         [--iters N] [--ucx-tls sm,self] [--get-path auto|ucx|both]
                         [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from tandem.contracts.block_key import BlockKey
from tandem.kvstore.server import parse_bytes
from tandem.launch import free_port

_DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} vCPU {cpu}, {platform.system()} {platform.release()}"


class _Stack:
    """redis-server + one store node as subprocesses (killed in :meth:`close`)."""

    def __init__(self, capacity_bytes: int, env: dict[str, str]) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server not found (make redis), or pass --redis-url")
        rport = free_port()
        self.redis_url = f"redis://127.0.0.1:{rport}/0"
        self.log = tempfile.NamedTemporaryFile(prefix="bench-kvstore-", suffix=".log",  # noqa: SIM115
                                               delete=False)
        self.procs = [subprocess.Popen(
            [exe, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        self.node_id = f"bench-{uuid.uuid4().hex[:6]}"
        self.procs.append(subprocess.Popen(
            [sys.executable, "-P", "-m", "tandem.kvstore.server",
             "--listen", f"127.0.0.1:{free_port()}", "--capacity", str(capacity_bytes),
             "--redis-url", self.redis_url, "--node-id", self.node_id,
             "--metrics-port", str(free_port())],
            env=env, stdout=self.log, stderr=subprocess.STDOUT))

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def _keys(n: int, fingerprint: bytes) -> list[BlockKey]:
    return [BlockKey(os.urandom(32), fingerprint) for _ in range(n)]


def _aligned_empty(shape: tuple[int, int]) -> np.ndarray:
    """A uint8 array starting on a 64-byte boundary, as torch allocates the engine's
    KV cache.

    NOTE: numpy's large arrays start 16 bytes past a page boundary, and glibc's
    ``rep movsb`` copies (up to the L2 size, on AMD) run several times slower into such
    a destination than into an aligned one, which made the memcpy reference of small
    batches meaningless (figures: docs/benchmarks.md, "Kernel measurements").
    """
    n = shape[0] * shape[1]
    raw = np.empty(n + 64, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip:skip + n].reshape(shape)


def _memcpy_times(src: list[np.ndarray], dst: list[np.ndarray], reps: int) -> list[float]:
    """Seconds per copy of every ``src[i]`` into ``dst[i]`` in this process, ``reps`` times.

    The reference the store is compared with: the same blocks, block by block as
    a get lands them, into a preallocated destination, warmed by one untimed copy
    and timed in a loop of its own (interleaved with transfers, a copy also pays
    for the other threads' wake-ups and cache misses, which made it look several times
    slower than memory is).
    """
    def copy() -> None:
        for a, b in zip(src, dst, strict=True):
            np.copyto(b, a)

    copy()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t)
    return times


def _shm_gets(client: object) -> int:
    """Node reads the client served from shared memory so far (0 for stand-ins)."""
    return int(getattr(client, "num_shm_reads", 0))


def _fingerprint(bs: int) -> bytes:
    # one layout per block size: a node checks a layout's blocks all have one size
    return f"bench{bs:011d}".encode()


def _measure_size(args: argparse.Namespace, client: Any, ucx_client: Any | None, size: int,
                  block_bytes: int, tls: Any) -> tuple[dict[str, Any], str]:
    """Put and get batches of about ``size`` bytes (blocks of at most ``block_bytes``)
    ``--iters`` times after a warm-up, check the bytes, and time a memcpy of the same
    batch; returns the size's record and its printed line."""
    n = max(1, size // block_bytes)
    bs = size // n
    total = n * bs
    iters = args.iters or max(5, min(40, (512 << 20) // total))
    rng = np.random.default_rng(size)
    # like the engine: blocks are consecutive rows of one cache tensor
    src_cache = _aligned_empty((n, bs))
    src_cache[:] = rng.integers(0, 255, (n, bs), dtype=np.uint8)
    dst_cache = _aligned_empty((n, bs))
    src = list(src_cache)
    dst = list(dst_cache)
    ucx_cache = _aligned_empty((n, bs)) if ucx_client else None
    put_s, get_s, ucx_s = [], [], []
    shm_before = _shm_gets(client)
    for it in range(iters + 1):  # iteration 0 warms up
        keys = _keys(n, _fingerprint(bs))
        if it == iters:
            dst_cache.fill(0)  # so that the check below sees what this get wrote
            if ucx_cache is not None:
                ucx_cache.fill(0)
        t = time.perf_counter()
        stored = client.put_blocks(keys, src)
        dt_put = time.perf_counter() - t
        assert stored == n, f"put stored {stored} of {n} blocks"
        t = time.perf_counter()
        got = client.get_blocks(keys, dst)
        dt_get = time.perf_counter() - t
        assert got == n, f"get loaded {got} of {n} blocks"
        if ucx_client is not None and ucx_cache is not None:
            t = time.perf_counter()
            got = ucx_client.get_blocks(keys, list(ucx_cache))
            dt_ucx = time.perf_counter() - t
            assert got == n, f"UCX get loaded {got} of {n} blocks"
            if it:
                ucx_s.append(dt_ucx)
        if it:
            put_s.append(dt_put)
            get_s.append(dt_get)
    assert np.array_equal(src_cache, dst_cache), "get returned other bytes than put"
    if ucx_cache is not None:
        assert np.array_equal(src_cache, ucx_cache), "UCX get returned other bytes"
    path = "shm" if _shm_gets(client) > shm_before else "ucx"
    copy_s = _memcpy_times(src, dst, max(iters, 20))
    p_put, p_get, p_copy = (statistics.median(x) for x in (put_s, get_s, copy_s))
    rec = {
        "batch_bytes": total, "block_bytes": bs, "num_blocks": n, "iters": iters,
        "put_gbps": total / p_put / 1e9, "get_gbps": total / p_get / 1e9,
        "memcpy_gbps": total / p_copy / 1e9,
        "put_p50_ms": p_put * 1e3, "get_p50_ms": p_get * 1e3,
        "memcpy_p50_ms": p_copy * 1e3, "ucx_tls": tls, "machine": _machine(),
        "get_path": path,
    }
    rec["get_vs_memcpy"] = rec["get_gbps"] / rec["memcpy_gbps"]
    line = (f"{total / 2**20:9.3f} MiB  {n:5d} x {bs:>9d} B  put {rec['put_gbps']:6.2f} "
            f"GB/s ({rec['put_p50_ms']:8.3f} ms)  get[{path}] {rec['get_gbps']:6.2f} "
            f"GB/s ({rec['get_p50_ms']:8.3f} ms)  memcpy {rec['memcpy_gbps']:6.2f} GB/s  "
            f"get/memcpy {rec['get_vs_memcpy']:5.1%}")
    if ucx_s:
        p_ucx = statistics.median(ucx_s)
        rec.update(get_ucx_gbps=total / p_ucx / 1e9, get_ucx_p50_ms=p_ucx * 1e3)
        rec["get_ucx_vs_memcpy"] = rec["get_ucx_gbps"] / rec["memcpy_gbps"]
        line += (f"  get[ucx] {rec['get_ucx_gbps']:6.2f} GB/s "
                 f"({rec['get_ucx_p50_ms']:8.3f} ms, {rec['get_ucx_vs_memcpy']:5.1%})")
    return rec, line


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure every batch size; returns one record per size."""
    from tandem.kvstore.client import ClientOptions, KVStoreClient, wait_for_nodes
    from tandem.kvstore.ucx import transports

    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    block_bytes = parse_bytes(args.block_bytes)
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    if args.ucx_tls:
        env["UCX_TLS"] = args.ucx_tls
        os.environ["UCX_TLS"] = args.ucx_tls  # this process's UCX, initialised below
    stack = None
    redis_url = args.redis_url
    if redis_url is None:
        stack = _Stack(max(sizes) * 3 + block_bytes, env)
        redis_url = stack.redis_url

    records = []
    try:
        get_path = getattr(args, "get_path", "auto")
        # the bench is an entry point: the environment is read here, once
        options = ClientOptions.from_environ(os.environ)
        no_shm = dataclasses.replace(options, shm=False)
        client = KVStoreClient(redis_url, timeout_s=60,
                               options=no_shm if get_path == "ucx" else options)
        ucx_client = KVStoreClient(redis_url, timeout_s=60, options=no_shm) \
            if get_path == "both" else None
        wait_for_nodes(client, 1, timeout_s=60)
        # the first block fixes the node's slot size: make it the largest
        warm = np.random.default_rng(0).integers(0, 255, block_bytes, dtype=np.uint8)
        client.put_blocks(_keys(1, _fingerprint(block_bytes)), [warm])
        tls = transports()
        for size in sizes:
            rec, line = _measure_size(args, client, ucx_client, size, block_bytes, tls)
            records.append(rec)
            print(line, flush=True)
        client.close()
        if ucx_client is not None:
            ucx_client.close()
    finally:
        if stack is not None:
            stack.close()
    return records


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tandem bench kvstore``. Returns the exit code."""
    p = argparse.ArgumentParser(prog="tandem bench kvstore", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=_DEFAULT_SIZES, help="batch sizes (K/M/G suffixes)")
    p.add_argument("--block-bytes", default="256K",
                   help="block size; smaller batches are one block")
    p.add_argument("--iters", type=int, default=0, help="iterations per size (0: auto)")
    p.add_argument("--ucx-tls", default=None, help="set UCX_TLS for node and client")
    p.add_argument("--get-path", choices=("auto", "ucx", "both"), default="auto",
                   help="auto: shared memory for a node on this host (unless TANDEM_KV_SHM=0), "
                        "else UCX; ucx: UCX only; both: also time UCX gets")
    p.add_argument("--no-shm", dest="get_path", action="store_const", const="ucx",
                   help="same as --get-path ucx")
    p.add_argument("--redis-url", default=None,
                   help="use running nodes registered in this Redis instead of starting one")
    p.add_argument("--json", default=None, help="write the records (a JSON list) here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    print(f"machine: {_machine()}")
    records = run(args)
    if records:
        print(f"UCX transports: {records[0]['ucx_tls']}; get path: "
              f"{', '.join(sorted({r['get_path'] for r in records}))}"
              + (" (and UCX, get[ucx])" if "get_ucx_gbps" in records[0] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
