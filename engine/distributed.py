"""The parallel state of one worker process: its tensor- and pipeline-parallel groups.

One engine spread over ``tensor_parallel_size * pipeline_parallel_size`` worker
processes; each calls ``init_distributed`` once before it builds its model. Ranks are
laid out as vLLM lays them out (``vllm/distributed/parallel_state.py``)::

    rank = pp_rank * tp_size + tp_rank

so a pipeline stage is ``tp_size`` consecutive ranks (one TP group), and the ranks
with the same ``tp_rank`` across stages form a PP group. The output rank (the one that
samples and returns the step's tokens) is the first TP rank of the last stage.

Built on ``torch.distributed``'s public API: gloo on CPU, NCCL on CUDA. Until
``init_distributed`` runs (the single-process path), ``get_tp_group`` and
``get_pp_group`` return a world of one whose collectives return their input, so the
model code calls them unconditionally and pays one integer comparison.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

#: op -> [calls, seconds] of this process's collectives (``collective_stats``).
_STATS: dict[str, list[float]] = {}


@contextmanager
def _timed(op: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        entry = _STATS.setdefault(op, [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - start


def collective_stats() -> dict[str, dict[str, float]]:
    """What this process's collectives cost since it started: op name ("all_reduce",
    "gather", "send", "recv") -> ``{"calls": n, "seconds": s}``, wall time inside the
    ``torch.distributed`` call (waiting for the peers included); groups of one call
    nothing and count nothing. Read by ``tandem bench throughput --tensor-parallel-size``."""
    return {op: {"calls": int(c), "seconds": float(t)} for op, (c, t) in _STATS.items()}


class GroupCoordinator:
    """One process group of this process (TP, PP or the whole world) and its collectives.

    Args:
        ranks: the global ranks of the group, in group order.
        rank: this process's global rank (one of ``ranks``).
        group: the ``torch.distributed`` group, or ``None`` for a group of one.

    Attributes:
        ranks / rank / group: as given.
        rank_in_group: index of ``rank`` in ``ranks``.
        world_size: ``len(ranks)``.
    """

    def __init__(self, ranks: list[int], rank: int, group: dist.ProcessGroup | None) -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the group's ranks {ranks}")
        self.ranks = list(ranks)
        self.rank = rank
        self.group = group
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place; returns ``t`` (any shape and dtype the
        backend reduces: float32 and bfloat16 on gloo and NCCL). Blocks until every
        rank of the group contributed. A group of one returns ``t`` untouched."""
        if self.world_size == 1:
            return t
        with _timed("all_reduce"):
            dist.all_reduce(t, group=self.group)
        return t

    def gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's ``t`` (same shape on each) along ``dim`` on group
        rank 0, in group order: ``[..., world_size * t.shape[dim], ...]`` there, ``None``
        on the other ranks. Blocks until the group took part. A group of one returns ``t``."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        if self.rank_in_group == 0:
            parts = [torch.empty_like(t) for _ in range(self.world_size)]
            with _timed("gather"):
                dist.gather(t, gather_list=parts, dst=self.ranks[0], group=self.group)
            return torch.cat(parts, dim=dim)
        with _timed("gather"):
            dist.gather(t, gather_list=None, dst=self.ranks[0], group=self.group)
        return None

    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        """Send ``tensors`` to the next rank of the group (the next pipeline stage), in
        the order of their sorted names; the receiver knows their shapes (``recv``).
        Blocks until the backend took the data.

        Raises:
            RuntimeError: on the last rank (there is no next stage).
        """
        if self.is_last_rank:
            raise RuntimeError("send() on the last rank of the group: there is no next stage")
        dst = self.ranks[self.rank_in_group + 1]
        with _timed("send"):
            for name in sorted(tensors):
                dist.send(tensors[name].contiguous(), dst=dst, group=self.group)

    def recv(
        self,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> dict[str, torch.Tensor]:
        """Receive what the previous rank of the group ``send``-s: one tensor per name of
        ``shapes`` (``name -> shape``), all of ``dtype`` on ``device``. Blocks until
        they arrived.

        Raises:
            RuntimeError: on the first rank (there is no previous stage).
        """
        if self.is_first_rank:
            raise RuntimeError("recv() on the first rank of the group: there is no previous stage")
        src = self.ranks[self.rank_in_group - 1]
        out: dict[str, torch.Tensor] = {}
        for name in sorted(shapes):
            t = torch.empty(shapes[name], dtype=dtype, device=device)
            with _timed("recv"):
                dist.recv(t, src=src, group=self.group)
            out[name] = t
        return out


def _single() -> GroupCoordinator:
    return GroupCoordinator([0], 0, None)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_SINGLE = _single()
# ParallelConfig.enable_expert_parallel of this process's engine (set by init_distributed):
# MoE blocks then split their experts whole over the TP group instead of slicing each.
_EXPERT_PARALLEL = False


def expert_parallel_enabled() -> bool:
    """Whether this process's MoE layers hold whole experts, ``num_experts / tp_size`` per
    TP rank (``ParallelConfig.enable_expert_parallel``); False before ``init_distributed``."""
    return _EXPERT_PARALLEL


def is_initialized() -> bool:
    """Whether ``init_distributed`` ran in this process (and no ``destroy_distributed`` since)."""
    return _WORLD is not None


def get_world_group() -> GroupCoordinator:
    """Every rank of the engine (a world of one before ``init_distributed``)."""
    return _WORLD if _WORLD is not None else _SINGLE


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group: the ranks of its pipeline stage."""
    return _TP if _TP is not None else _SINGLE


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline-parallel group: one rank per stage, same ``tp_rank``."""
    return _PP if _PP is not None else _SINGLE


def _check_sizes(tp_size: int, pp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")


def init_distributed(
    rank: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str,
    timeout: timedelta | None = None,
    enable_expert_parallel: bool = False,
) -> None:
    """Join the engine's process group and build this rank's TP and PP groups.

    Every rank of the world (``tp_size * pp_size`` processes) must call it with the
    same sizes, ``init_method`` and ``backend``; it blocks until all have joined. With
    NCCL the process's current CUDA device becomes ``rank % device_count`` (one
    device per rank on one node).

    Args:
        rank: this process's global rank, ``pp_rank * tp_size + tp_rank``.
        tp_size / pp_size: tensor- and pipeline-parallel sizes.
        init_method: a ``torch.distributed`` rendezvous URL (``tcp://host:port`` or
            ``file:///path``).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        timeout: how long a collective (and the rendezvous) waits for the other
            ranks before it raises; ``None``: ``torch.distributed``'s default.
        enable_expert_parallel: MoE layers split their experts over the TP group
            (``expert_parallel_enabled``).

    Raises:
        ValueError: a size below 1, ``rank`` outside the world, an unknown backend.
        RuntimeError: when this process already joined a group.
    """
    global _WORLD, _TP, _PP, _EXPERT_PARALLEL
    _check_sizes(tp_size, pp_size)
    world = tp_size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if _WORLD is not None or dist.is_initialized():
        raise RuntimeError("init_distributed() called twice in one process")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=init_method, world_size=world, rank=rank, timeout=timeout
    )
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    # new_group is collective: every rank creates every group, in the same order.
    # Groups of one need no process group (their collectives never reach the backend).
    tp_ranks = [[p * tp_size + t for t in range(tp_size)] for p in range(pp_size)]
    pp_ranks = [[p * tp_size + t for p in range(pp_size)] for t in range(tp_size)]
    tp_groups = [dist.new_group(r, timeout=timeout) if tp_size > 1 else None for r in tp_ranks]
    pp_groups = [dist.new_group(r, timeout=timeout) if pp_size > 1 else None for r in pp_ranks]
    _WORLD = GroupCoordinator(list(range(world)), rank, dist.group.WORLD)
    _TP = GroupCoordinator(tp_ranks[pp_rank], rank, tp_groups[pp_rank])
    _PP = GroupCoordinator(pp_ranks[tp_rank], rank, pp_groups[tp_rank])
    _EXPERT_PARALLEL = bool(enable_expert_parallel)


def destroy_distributed() -> None:
    """Leave the process group and forget the groups (back to a world of one).
    Idempotent; a no-op where ``init_distributed`` never ran."""
    global _WORLD, _TP, _PP, _EXPERT_PARALLEL
    _WORLD = _TP = _PP = None
    _EXPERT_PARALLEL = False
    if dist.is_initialized():
        dist.destroy_process_group()


def kv_head_range(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The KV heads (indices into the full model's ``num_kv_heads``) that TP rank
    ``tp_rank`` holds.

    ``num_kv_heads >= tp_size``: an equal contiguous share each. ``num_kv_heads <
    tp_size`` (``tp_size`` a multiple of it): every head is replicated on ``tp_size //
    num_kv_heads`` consecutive ranks and each rank holds one (vLLM's
    ``QKVParallelLinear`` rule), the head its query heads attend to.

    Raises:
        ValueError: naming ``tensor_parallel_size`` when ``num_kv_heads`` is neither
            divisible by it nor divides it; ``tp_rank`` outside ``[0, tp_size)``.
    """
    _check_sizes(tp_size, 1)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide num_key_value_heads "
                f"{num_kv_heads} (or be a multiple of it)"
            )
        per = num_kv_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must be a multiple of num_key_value_heads "
            f"{num_kv_heads} (or divide it)"
        )
    head = tp_rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def pp_layer_range(pp_rank: int, pp_size: int, num_layers: int) -> range:
    """The decoder layers (global indices) of pipeline stage ``pp_rank``: contiguous,
    ``num_layers // pp_size`` each, the remainder one more each on the stages just
    before the last (the last stage also runs the LM head; vLLM's ``get_pp_indices``).

    Raises:
        ValueError: naming ``pipeline_parallel_size`` when it exceeds ``num_layers``
            (a stage without layers); ``pp_rank`` outside ``[0, pp_size)``.
    """
    _check_sizes(1, pp_size)
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} exceeds num_hidden_layers {num_layers}"
        )
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[pp_size - 2 - i] += 1
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


def driver_rank(tp_size: int, pp_size: int) -> int:
    """The global rank that samples and returns each step's output: the first TP
    rank of the last pipeline stage, ``(pp_size - 1) * tp_size``."""
    _check_sizes(tp_size, pp_size)
    return (pp_size - 1) * tp_size
