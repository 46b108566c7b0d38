"""How ``tandem up`` shares one host among its engines: which engines run on GPUs or share
CPU cores (and so take step turns), each engine's share of the KV cache memory and of a
shared GPU, the flags and environment that carry the plan to each engine.

Pure functions of the frozen ``StackConfig`` (``tandem/up.py``), so each rule is tested
without starting a process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tandem.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION

if TYPE_CHECKING:
    from tandem.up import StackConfig


#: Most of the host memory available at start that the stack's KV caches may take together
#: (the rest: weights, activations, router, store, the user's other programs).
KV_SHARE_OF_AVAILABLE = 0.5
#: Per-engine cap, as the engine's own CPU default (engine/model_runner.py).
KV_CAP_BYTES = 4 << 30


#: The step-turn lock file of engines that share cores (``engine/cpu_turns.py``), in the
#: stack's temporary folder.
CPU_TURNS_FILE = "cpu-turns.lock"
#: ``--max-num-batched-tokens`` of engines that take turns, unless the user sets it: a
#: turn waits for the other engine's whole step, so a long prompt's 2048-token chunks
#: would stall the streams beside it (docs/benchmarks.md, "turns fair in time").
TURNS_MAX_NUM_BATCHED_TOKENS = 512


def engines_on_gpu(cfg: StackConfig) -> bool:
    """The engines run on a GPU (``--device cuda[:N]`` in ``engine_args``)."""
    return any("cuda" in " ".join(args) for args in _every_engines_args(cfg))


def shares_cpu_cores(cfg: StackConfig) -> bool:
    """Several engines of the stack run on the same CPU cores: more than one engine,
    none pinned (``cpus_per_engine``), none on a GPU."""
    num_engines = cfg.replicas if cfg.colocated else cfg.num_prefill + cfg.num_decode
    return num_engines > 1 and not cfg.cpus_per_engine and not engines_on_gpu(cfg)


def takes_cpu_turns(cfg: StackConfig) -> bool:
    """The engines share cores (:func:`shares_cpu_cores`) and take turns for each model
    step (``--shared-cpu-lock``, ``engine/cpu_turns.py``): unless the user turned it off
    (``--no-cpu-turns``) or the engines run pipeline parallel (their batches in flight
    overlap)."""
    return shares_cpu_cores(cfg) and cfg.cpu_turns and all(
        _pipeline_size(args) == 1 for args in _every_engines_args(cfg))


def _every_engines_args(cfg: StackConfig) -> list[list[str]]:
    """The extra flags of each kind of engine in the stack (the per-role ones after the
    common ones)."""
    if cfg.colocated:
        return [cfg.engine_args]
    return [[*cfg.engine_args, *cfg.prefill_engine_args],
            [*cfg.engine_args, *cfg.decode_engine_args]]


def sets_flag(engine_args: Sequence[str], flag: str) -> bool:
    """``flag`` is among the engines' flags (``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in engine_args)


def _pipeline_size(engine_args: Sequence[str]) -> int:
    """The ``--pipeline-parallel-size`` / ``-pp`` among the engines' flags (1 when unset;
    a value that is not a number is left for the engine to refuse)."""
    size = "1"
    for i, a in enumerate(engine_args):
        for flag in ("--pipeline-parallel-size", "-pp"):
            if a == flag and i + 1 < len(engine_args):
                size = engine_args[i + 1]
            elif a.startswith(flag + "="):
                size = a[len(flag) + 1:]
    return int(size) if size.isdigit() else 1


def _flag_value(engine_args: Sequence[str], flags: Sequence[str], default: str) -> str:
    """The last value of any of ``flags`` among the engines' flags (``--flag value`` or
    ``--flag=value``), else ``default``."""
    value = default
    for i, a in enumerate(engine_args):
        for flag in flags:
            if a == flag and i + 1 < len(engine_args):
                value = engine_args[i + 1]
            elif a.startswith(flag + "="):
                value = a[len(flag) + 1:]
    return value


def engine_cuda_devices(engine_args: Sequence[str]) -> frozenset[int]:
    """The CUDA devices an engine with these flags runs on (empty on the CPU): its
    ``--device`` index ("cuda": 0, the device a fresh process starts on); with several
    ranks, devices ``0..ranks-1`` (the workers' rule: rank ``r`` on device ``r %
    device_count``, ``engine/distributed.py``). A bad value is left for the engine to
    refuse."""
    device = _flag_value(engine_args, ("--device",), "cpu")
    if not device.startswith("cuda"):
        return frozenset()
    ranks = 1
    for flags in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        size = _flag_value(engine_args, flags, "1")
        ranks *= int(size) if size.isdigit() and int(size) > 0 else 1
    if ranks > 1:
        return frozenset(range(ranks))
    index = device.partition(":")[2]
    return frozenset({int(index) if index.isdigit() else 0})


def _engine_instances(cfg: StackConfig) -> list[list[str]]:
    """The extra flags of every engine instance of the stack, one list each."""
    if cfg.colocated:
        return [cfg.engine_args] * cfg.replicas
    prefill, decode = _every_engines_args(cfg)
    return [prefill] * cfg.num_prefill + [decode] * cfg.num_decode


def engines_share_a_gpu(cfg: StackConfig) -> bool:
    """Two or more engines of the stack run on one CUDA device."""
    seen: set[int] = set()
    for args in _engine_instances(cfg):
        devices = engine_cuda_devices(args)
        if seen & devices:
            return True
        seen |= devices
    return False


def gpu_memory_utilization_args(cfg: StackConfig, engine_args: Sequence[str]) -> list[str]:
    """``--gpu-memory-utilization`` for an engine of the stack with these flags: its share
    of the GPUs it runs on, ``cfg.gpu_memory_utilization`` divided by the most engines
    of the stack on any one of them (rounded down to 1/1000: the shares never add up
    to more), so that two engines on one GPU take 0.45 of it each instead of 0.9 each.

    Nothing is added on the CPU, for an engine alone on its GPUs that keeps the
    default (0.9), or where the user set the flag for this engine.
    """
    if sets_flag(engine_args, "--gpu-memory-utilization"):
        return []
    mine = engine_cuda_devices(engine_args)
    if not mine:
        return []
    sharing = max(sum(1 for args in _engine_instances(cfg) if d in engine_cuda_devices(args))
                  for d in mine)
    if sharing <= 1 and cfg.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION:
        return []
    share = int(cfg.gpu_memory_utilization * 1000 / max(1, sharing)) / 1000
    return ["--gpu-memory-utilization", str(share)]


def parts_env(cfg: StackConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of the stack's processes: ``base`` plus, for pinned engines
    (``cpus_per_engine``), that many OpenMP threads unless the user set them. Every
    engine keeps the services' OpenMP spin (``tandem.cli.configure_openmp``)."""
    env = dict(base)
    if cfg.cpus_per_engine:
        env.setdefault("OMP_NUM_THREADS", str(cfg.cpus_per_engine))
    return env


def kv_cache_args(cfg: StackConfig, available_bytes: int | None = None) -> list[str]:
    """``--kv-cache-memory`` for each engine of the stack: a share of the memory available now.

    Each engine on its own sizes its KV cache from the memory available when *it* starts;
    engines starting together all see the same free memory, so N of them would claim it N
    times over (4 engines x 4 GiB on an 8 GiB laptop: out of memory). Splitting
    ``KV_SHARE_OF_AVAILABLE`` of it between them keeps the sum bounded. Nothing is added
    when the user sized the cache (``--kv-cache-memory`` / ``--num-kv-blocks`` in
    ``engine_args``) or the engines run on a GPU (sized from device memory).

    Args:
        available_bytes: host memory available (default: measured with psutil).
    """
    args = " ".join(cfg.engine_args)
    if engines_on_gpu(cfg) or any(f in args for f in ("--kv-cache-memory", "--num-kv-blocks")):
        return []
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    num_engines = cfg.replicas if cfg.colocated else cfg.num_prefill + cfg.num_decode
    budget = int(available_bytes * KV_SHARE_OF_AVAILABLE) // max(1, num_engines)
    return ["--kv-cache-memory", str(max(64 << 20, min(KV_CAP_BYTES, budget)))]
