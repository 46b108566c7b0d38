"""Native CPU kernels (``kernels/csrc/*.c``), built on first use and loaded with ctypes.

Why a C kernel: paged decode attention is memory bound, and the torch path has to
gather every context block into a padded copy before SDPA can run (see
``kernels/attention.py``); ``paged_decode_attention_cpu`` reads K/V in place.

The shared library is compiled once per machine with the system C compiler
(``$CC``, else ``cc``/``gcc``), ``-O3 -march=native -fopenmp -ffast-math`` (compile step only), into
``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem/kernels``), under a name that
hashes the source, the flags and the CPU's feature flags, so a cache shared by
different CPUs never loads code built for another one. Concurrent processes build
into a temporary file and rename it into place. Where no compiler is found or the
build fails, ``load()`` returns ``None`` (logged once) and callers use the torch
reference. ``TANDEM_CPU_KERNELS=0`` disables the native path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
# -ffast-math only at compile time (it lets GCC use libmvec's vector expf); the
# separate link step leaves it out, so crtfastmath (which would flush denormals
# process-wide, torch included) is never linked in.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-std=gnu11", "-ffast-math"]
_LDFLAGS = ["-shared", "-fopenmp"]
# Limits compiled into the kernel (stack scratch per work item).
MAX_GROUP = 32
MAX_HEAD_DIM = 256
VECTOR_WIDTH = 16  # floats per vector; head_dim must be a multiple

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_ARGTYPES = [
    ctypes.c_int,  # is_bf16
    _ptr, _i64, _i64,  # q, strides (token, head)
    _ptr, _i64, _i64, _i64,  # k cache, strides (block, offset, head)
    _ptr, _i64, _i64, _i64,  # v cache, strides
    _ptr, _i64, _ptr,  # block tables, row stride, seq lens
    _ptr, _i64, _i64,  # out, strides (token, head)
    _i64, _i64, _i64, _i64, _i64,  # nd, num_heads, num_kv_heads, head_dim, block_size
    ctypes.c_float, _i64, ctypes.c_int,  # scale, window, threads
]  # fmt: skip


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "tandem"
    return base / "kernels"


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _build(cc: str) -> Path:
    """Compile the kernel library (or reuse a cached build); returns its path.

    Raises:
        RuntimeError: with the compiler's output when the build fails.
    """
    src = _SRC.read_bytes()
    key = hashlib.sha256(
        src
        + " ".join([cc, *_CFLAGS, *_LDFLAGS]).encode()
        + _cpu_flags().encode()
        + platform.machine().encode()
    ).hexdigest()[:16]
    out_dir = _cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"tandem_cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for cmd in (
            [cc, *_CFLAGS, "-c", str(_SRC), "-o", obj],
            [cc, *_LDFLAGS, obj, "-o", tmp, "-lm"],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[:2000]}"
                )
        os.replace(tmp, lib)  # atomic: a concurrent builder's file is equally good
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return lib


@functools.cache
def load() -> ctypes.CDLL | None:
    """The loaded kernel library, or ``None`` when disabled or unbuildable (logged once)."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    if platform.system() != "Linux":
        return None
    cc = _compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU decode attention uses the torch path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable (%s): using the torch path", exc)
        return None
    lib.paged_decode_attention.argtypes = _ARGTYPES
    lib.paged_decode_attention.restype = ctypes.c_int
    return lib


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention_cpu`` can serve these tensors."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    return (
        group <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % VECTOR_WIDTH == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and load() is not None
    )


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention straight from the paged cache (no gather), on the CPU.

    Args:
        q: ``[nd, num_heads, head_dim]`` float32 or bfloat16, one query token per
            sequence (its last position), last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (strided layer views are fine; last dim contiguous), ``q``'s dtype.
        block_tables: ``[nd, max_blocks]`` int64; seq_lens: ``[nd]`` int64
            context lengths in tokens, including the new token.
        scale: softmax scale; sliding_window: optional window in tokens.

    Returns:
        ``[nd, num_heads, head_dim]`` in ``q.dtype`` (float32 accumulation).

    Raises:
        RuntimeError: when the library is unavailable (check ``supports`` first)
            or the kernel reports an unsupported shape or allocation failure.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available")
    nd, num_heads, head_dim = q.shape
    out = torch.empty((nd, num_heads, head_dim), dtype=q.dtype)
    if nd == 0:
        return out
    bt = block_tables.contiguous()
    lens = seq_lens.contiguous()
    window = sliding_window if sliding_window is not None else 2**62
    rc = lib.paged_decode_attention(
        int(q.dtype == torch.bfloat16),
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.data_ptr(), bt.stride(0), lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        nd, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        float(scale), window, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention_cpu failed with code {rc}")
    return out
