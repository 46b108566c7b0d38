"""The one place that decides which kernel implementation an op runs.

Three backends, as vLLM's platform / attention-backend selection has them:

* ``TRITON``: the Triton kernels, for CUDA tensors where ``triton`` is importable;
* ``CPU_NATIVE``: the C kernels of ``kernels/csrc`` (``kernels/cpu_ext.py``), for
  CPU tensors where a variant of the library could be built and loaded;
* ``TORCH``: the torch references, for everything else (and the oracle in tests).

``KernelBackends`` decides from a frozen ``KernelConfig`` and the ``Platform``
detected once; the op wrappers ask ``current().for_tensor(t)``. A CPU-native
wrapper may still decline a call (a shape its kernel does not take) and run the
torch reference: the backend says which implementation is tried first, the
wrapper's ``supports`` check whether it serves.

The config comes from the edge: the CLI and each service's entry point build it
(``KernelConfig.from_env``) and call ``configure`` before the first op; a process
that never does gets ``KernelConfig()``'s documented defaults (native kernels on,
the cache in ``~/.cache/tandem/kernels``, the first of cc / gcc / clang, the best
variant the CPU can execute).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import logging
import platform
import subprocess
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.kernels import native_build
from tandem.kernels.native_abi import NativeLibrary
from tandem.kernels.native_build import IsaVariant

logger = logging.getLogger(__name__)


class KernelBackend(enum.Enum):
    """Which implementation family serves an op."""

    TORCH = "torch"
    CPU_NATIVE = "cpu_native"
    TRITON = "triton"


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "kernels"


@dataclass(frozen=True)
class KernelConfig:
    """How the kernel backend is chosen and the native library built.

    Attributes:
        cpu_native: whether CPU tensors may use the native kernels (else torch).
        cache_dir: where native builds are kept.
        compiler: the C compiler's command, or ``None`` for the first of cc, gcc,
            clang on ``PATH``.
        isa: the name of the native variant to load (``native_build``), or
            ``None`` for the best one this CPU can execute.

    Raises:
        ValueError: naming ``isa`` when no machine has such a variant.
    """

    cpu_native: bool = True
    cache_dir: Path = field(default_factory=_default_cache_dir)
    compiler: str | None = None
    isa: str | None = None

    def __post_init__(self) -> None:
        known = {v.name for v in (*native_build.X86_64_VARIANTS, native_build.BASELINE_VARIANT)}
        if self.isa is not None and self.isa not in known:
            raise ValueError(f"isa must be one of {sorted(known)}, got {self.isa!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KernelConfig:
        """The config named by the environment (for entry points only):
        ``TANDEM_CPU_KERNELS=0`` disables the native kernels, ``TANDEM_CACHE_DIR``
        roots the cache (``$TANDEM_CACHE_DIR/kernels``), ``CC`` names the compiler
        and ``TANDEM_CPU_ISA`` a variant. Unset variables keep the defaults.

        Raises:
            ValueError: on a ``TANDEM_CPU_ISA`` no machine has.
        """
        root = environ.get("TANDEM_CACHE_DIR")
        return cls(
            cpu_native=environ.get("TANDEM_CPU_KERNELS", "1") != "0",
            cache_dir=Path(root) / "kernels" if root else _default_cache_dir(),
            compiler=environ.get("CC") or None,
            isa=environ.get("TANDEM_CPU_ISA") or None,
        )


def read_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line; empty where
    there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Platform:
    """Facts about this machine that the selection reads, detected once.

    Attributes:
        system / machine: ``platform.system()`` / ``platform.machine()``.
        cpu_flags: the CPU's feature flags (``read_cpu_flags``).
        triton: whether the ``triton`` package is importable.
    """

    system: str
    machine: str
    cpu_flags: frozenset[str]
    triton: bool

    @classmethod
    def detect(cls) -> Platform:
        """This machine's facts."""
        return cls(
            system=platform.system(),
            machine=platform.machine(),
            cpu_flags=read_cpu_flags(),
            triton=importlib.util.find_spec("triton") is not None,
        )

    @property
    def variants(self) -> tuple[IsaVariant, ...]:
        """The native variants for this machine's architecture, worst to best."""
        return native_build.variants_for(self.machine)

    def can_execute(self, variant: IsaVariant) -> bool:
        """Whether this CPU has every flag ``variant`` needs."""
        return not variant.missing_flags(self.cpu_flags)

    @property
    def fast_bf16_gemm(self) -> bool:
        """Whether oneDNN has a native bf16 GEMM on this CPU (AVX-512 BW/VL/DQ,
        AVX-NE-CONVERT or AMX-BF16); without one torch's bf16 matmul falls back to
        slow reference code, and bf16 linears are better computed in float32."""
        f = self.cpu_flags
        return {"avx512bw", "avx512vl", "avx512dq"} <= f or bool({"avx_ne_convert", "amx_bf16"} & f)


class KernelBackends:
    """The kernel selection of one process: decides per tensor, loads the native
    library on first need (once; a failure is logged once and means torch).

    Args:
        config: how to choose and build (``KernelConfig``).
        platform: this machine's facts (``Platform.detect()``).
    """

    def __init__(self, config: KernelConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self._native: NativeLibrary | None = None
        self._native_tried = False
        self._lock = threading.Lock()

    def for_tensor(self, t: torch.Tensor) -> KernelBackend:
        """The backend an op on ``t`` tries first."""
        if t.is_cuda:
            return KernelBackend.TRITON if self.platform.triton else KernelBackend.TORCH
        if t.device.type == "cpu" and self.native() is not None:
            return KernelBackend.CPU_NATIVE
        return KernelBackend.TORCH

    def native_variant(self) -> IsaVariant | None:
        """The variant this process loads: ``config.isa``, else the best one the
        CPU can execute (``None`` where none can run)."""
        variants = self.platform.variants
        if self.config.isa is not None:
            return next((v for v in variants if v.name == self.config.isa), None)
        runnable = [v for v in variants if self.platform.can_execute(v)]
        return runnable[-1] if runnable else None

    def build(self, variant: IsaVariant) -> Path:
        """Compile ``variant`` (cached) with the configured compiler; it need not be
        executable here.

        Raises:
            RuntimeError: no compiler, or the build failed (the compiler's output).
            subprocess.SubprocessError: a step timed out.
        """
        cc = native_build.find_compiler(self.config.compiler)
        if cc is None:
            raise RuntimeError("no C compiler found (cc, gcc or clang)")
        flags = " ".join(sorted(self.platform.cpu_flags))
        return native_build.build_variant(variant, cc, self.config.cache_dir, flags)

    def load(self, variant: IsaVariant) -> NativeLibrary:
        """Build and load ``variant`` (tests load each executable one).

        Raises:
            ValueError: naming the CPU flags ``variant`` needs and this CPU lacks.
            RuntimeError, OSError, subprocess.SubprocessError: see ``build``.
        """
        missing = variant.missing_flags(self.platform.cpu_flags)
        if missing:
            raise ValueError(f"variant {variant.name!r} needs CPU flags {missing}")
        return NativeLibrary(self.build(variant), variant.name)

    def native(self) -> NativeLibrary | None:
        """The native library of this process, or ``None`` when disabled, on a
        system other than Linux, or unbuildable (logged once)."""
        if self._native_tried:
            return self._native
        with self._lock:
            if not self._native_tried:
                self._native = self._load_default()
                self._native_tried = True
        return self._native

    def _load_default(self) -> NativeLibrary | None:
        if not self.config.cpu_native or self.platform.system != "Linux":
            return None
        variant = self.native_variant()
        if variant is None:
            logger.warning("no native kernel variant runs on this CPU: using the torch path")
            return None
        try:
            lib = self.load(variant)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
            logger.warning("native CPU kernels unavailable (%s): using the torch path", exc)
            return None
        logger.info("native CPU kernels: variant %s (%s)", variant.name, lib.path)
        return lib


_current: KernelBackends | None = None
_current_lock = threading.Lock()


def configure(config: KernelConfig) -> KernelBackends:
    """Make ``config`` this process's kernel selection (entry points call it once,
    before the first op) and return the selection."""
    global _current
    with _current_lock:
        _current = KernelBackends(config, Platform.detect())
        return _current


def current() -> KernelBackends:
    """This process's kernel selection (``KernelConfig()`` unless ``configure`` ran)."""
    return _current if _current is not None else configure(KernelConfig())


@contextlib.contextmanager
def selected(backends: KernelBackends) -> Iterator[KernelBackends]:
    """Run the block with ``backends`` as the selection, then restore the previous
    one (tests: a variant, the torch path, a failing build)."""
    global _current
    previous = _current
    _current = backends
    try:
        yield backends
    finally:
        _current = previous


def with_native(lib: NativeLibrary | None) -> KernelBackends:
    """A selection like ``current()`` whose native library is ``lib`` (``None``:
    the torch path), for ``selected``."""
    base = current()
    backends = KernelBackends(base.config, base.platform)
    backends._native, backends._native_tried = lib, True
    return backends
