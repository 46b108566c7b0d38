"""Building the CPU kernel library (``kernels/csrc``) for an explicit ISA variant.

The sources choose their code paths by the compiler's target macros
(``__AVX2__``, ``__AVX512BF16__``, ``__AMX_TILE__`` ...), so one source tree gives
one library per target. On x86-64 the variants are the psABI levels and the
AVX-512 extensions the kernels use:

========== ======================================== ==============================
variant    compiler target                          code paths
========== ======================================== ==============================
generic    ``-march=x86-64-v2``                     portable C (auto-vectorised)
avx2       ``-march=x86-64-v3``                     AVX2 + FMA decode attention
avx512     ``-march=x86-64-v4``                     AVX-512 auto-vectorised C
avx512bf16 ``x86-64-v4 -mavx512bf16``               VDPBF16PS linears, attention,
                                                    fused decode layers
amx        ``x86-64-v4 -mavx512bf16 -mamx-*``       the same on AMX tiles
========== ======================================== ==============================

Each variant lists the ``/proc/cpuinfo`` flags a CPU needs to execute it, so the
runtime (``kernels/backend.py``) loads the best one the CPU can run and the tests
build and run every one it can (and compile the rest). Other machines get one
``baseline`` variant with the compiler's default target.

Builds land in a cache directory under a name that hashes the sources, the
flags, the compiler and the CPU's flags (``-mtune=native`` tunes for the build
host), so a cache shared by different CPUs never serves code tuned or built for
another one. Concurrent processes build into a temporary file and rename it into
place.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# -ffast-math only at compile time (it lets GCC use libmvec's vector expf); the
# separate link step leaves it out, so crtfastmath (which would flush denormals
# process-wide, torch included) is never linked in.
_CFLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=gnu11")
# (source, extra flags): one file per op family. The elementwise kernels round
# like torch step by step, so they must not contract a*b-c*d into FMAs.
_ELEMENTWISE = ("-ffast-math", "-ffp-contract=off")
SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("paged_attention_cpu.c", ("-ffast-math",)),
    ("norm_cpu.c", _ELEMENTWISE),
    ("rotary_cpu.c", _ELEMENTWISE),
    ("activation_cpu.c", _ELEMENTWISE),
    ("cache_cpu.c", _ELEMENTWISE),
    ("sampling_cpu.c", _ELEMENTWISE),
    ("race_cpu.c", ("-ffast-math",)),
    ("bf16_linear_cpu.c", ()),
    ("prefill_attention_cpu.c", ()),
    ("decode_layers_cpu.c", ()),
    # step-by-step rounding: the scalar GGUF unpacking equals the gguf package's
    ("gguf_quant_cpu.c", ("-ffp-contract=off",)),
    # step-by-step rounding: the epilogue equals the torch reference bit for bit
    ("int8_linear_cpu.c", ("-ffp-contract=off",)),
    ("int4_linear_cpu.c", ("-ffp-contract=off",)),
    ("gguf_dot_cpu.c", ()),
)
HEADERS = ("tandem_kernels.h", "team.h", "simd_math.h", "elementwise.h", "gguf_quant_simd.h",
           "gguf_dot_simd.h")
# -Bsymbolic: the library's calls between its own files bind inside it, so the
# variants loaded side by side in one test process never call into each other.
_LDFLAGS = ("-shared", "-fopenmp", "-Wl,-Bsymbolic")
# per compiler step; generous: a loaded 2-core host compiles the attention file slowly
_BUILD_TIMEOUT_S = 1200


@dataclass(frozen=True)
class IsaVariant:
    """One compiler target of the kernel library.

    Attributes:
        name: the variant's name (``KernelConfig.isa`` takes it).
        target_flags: compiler flags selecting the target.
        cpu_flags: ``/proc/cpuinfo`` flags a CPU needs to execute the build.
    """

    name: str
    target_flags: tuple[str, ...]
    cpu_flags: frozenset[str]

    def missing_flags(self, cpu_flags: frozenset[str]) -> list[str]:
        """The flags this variant needs that ``cpu_flags`` lacks, sorted."""
        return sorted(self.cpu_flags - cpu_flags)


_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_V4_BF16 = ("-march=x86-64-v4", "-mavx512bf16")
# Worst to best: the runtime takes the last one the CPU can execute.
X86_64_VARIANTS = (
    IsaVariant("generic", ("-march=x86-64-v2",), _V2),
    IsaVariant("avx2", ("-march=x86-64-v3",), _V3),
    IsaVariant("avx512", ("-march=x86-64-v4",), _V4),
    IsaVariant("avx512bf16", _V4_BF16, _V4 | {"avx512_bf16"}),
    IsaVariant(
        "amx",
        (*_V4_BF16, "-mamx-tile", "-mamx-bf16"),
        _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
    ),
)
BASELINE_VARIANT = IsaVariant("baseline", (), frozenset())


def variants_for(machine: str) -> tuple[IsaVariant, ...]:
    """The variants for a ``platform.machine()``, worst to best."""
    return X86_64_VARIANTS if machine in ("x86_64", "AMD64") else (BASELINE_VARIANT,)


def find_compiler(preferred: str | None) -> str | None:
    """``preferred`` where it is on ``PATH``, else the first of cc, gcc, clang."""
    for cand in (preferred, "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _run(cmd: list[str]) -> None:
    # Own process group: on a timeout the compiler driver's children (cc1) are
    # killed with it instead of compiling on as orphans.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {stderr.strip()[:2000]}")


def build_variant(variant: IsaVariant, compiler: str, cache_dir: Path, host_flags: str) -> Path:
    """Compile the kernel library for ``variant`` (or reuse a cached build).

    Args:
        variant: the target; it need not be executable here (compile-only checks).
        compiler: the C compiler's command (see ``find_compiler``).
        cache_dir: where builds are kept (created if missing).
        host_flags: the build host's CPU flags, part of the cache key.

    Returns:
        The path of the shared library.

    Raises:
        RuntimeError: with the compiler's output when a step fails.
        subprocess.SubprocessError: when a step times out.
    """
    target = (*variant.target_flags, "-mtune=native") if variant.target_flags else ()
    cflags = (*_CFLAGS, *target)
    digest = hashlib.sha256()
    for name, extra in SOURCES:
        digest.update((CSRC / name).read_bytes() + " ".join(extra).encode())
    for name in HEADERS:
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join([compiler, *cflags, *_LDFLAGS]).encode())
    digest.update(host_flags.encode() + platform.machine().encode())
    lib = cache_dir / f"tandem_cpu_kernels-{variant.name}-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    objs = [f"{tmp[:-3]}-{i}.o" for i in range(len(SOURCES))]
    try:
        for (name, extra), obj in zip(SOURCES, objs, strict=True):
            _run([compiler, *cflags, *extra, "-c", str(CSRC / name), "-o", obj])
        _run([compiler, *_LDFLAGS, *objs, "-o", tmp, "-lm"])
        os.replace(tmp, lib)  # atomic: a concurrent builder's file is equally good
    finally:
        for path in (tmp, *objs):
            if os.path.exists(path):
                os.unlink(path)
    return lib


def compile_check(variant: IsaVariant, compiler: str) -> None:
    """Compile every source for ``variant`` without optimising or linking: the check
    that a variant this CPU cannot execute still builds (its intrinsics, its types
    against the header).

    Raises:
        RuntimeError: with the compiler's output when a source does not compile.
    """
    for name, extra in SOURCES:
        _run(
            [compiler, *_CFLAGS, *variant.target_flags, *extra, "-O0", "-c", str(CSRC / name)]
            + ["-o", os.devnull]
        )
