"""The "mp" executor backend: one worker process per rank (vLLM v1's ``MultiprocExecutor``).

``tensor_parallel_size * pipeline_parallel_size`` worker processes
(``engine/executor/worker_proc.py``) each load their shard of the model and join one
``torch.distributed`` group (gloo on the CPU, NCCL on CUDA). Each step the engine core
encodes its ``SchedulerOutput`` once (``step_message``: new requests in full, then only
what changed) and writes it to one shared-memory ring buffer that every worker reads
(``shm_broadcast``: one writer, many readers, no socket or pipe per step). Every worker
answers on its own reply queue; the driver rank (last pipeline stage, first
tensor-parallel rank) answers with the sampled tokens, the others with an empty reply,
so an error on any rank reaches the engine.

Steps can be submitted ahead (``submit_step``, up to ``max_concurrent_batches`` =
``pipeline_parallel_size``): the broadcast queue hands every rank the steps in
submission order and each rank answers them in that order, so the oldest step's
replies are always the next ones on every reply queue. While stage 1 runs one step,
stage 0 already runs the next (vLLM v1's batch queue).

A worker that dies makes the executor fail fast: the wait for its reply checks that
every worker is alive and raises ``EngineDeadError``; the engine's callers then fail
their requests and the service exits, instead of hanging in a collective.

On the CPU, when a KV connector needs the cache (disaggregated roles), each rank's KV
cache is a ``memfd`` the executor creates and the worker maps (``MAP_SHARED``), so the
connector in the engine core reads and writes the ranks' blocks directly
(``kv_shards.ShardedKVCache``). A memfd has no name: nothing is left behind when a
process dies.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tandem.engine import distributed
from tandem.engine.config import EngineConfig
from tandem.engine.executor.abstract import EngineDeadError, Executor
from tandem.engine.executor.main_guard import check_main_guard
from tandem.engine.executor.shm_broadcast import Handle, MessageQueue, dequeue_any
from tandem.engine.executor.step_message import StepEncoder
from tandem.engine.executor.worker_proc import WorkerSpec, worker_main
from tandem.engine.model_facts import ModelFacts
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.process import BaseProcess

    from transformers import PreTrainedTokenizerBase

    from tandem.engine.kv_connector import KVConnectorWorker
    from tandem.engine.model_loader import LoadedModel

logger = logging.getLogger(__name__)

#: Seconds a worker gets to load its shard and report ready.
WORKER_STARTUP_TIMEOUT_S = 600.0
#: Seconds to wait for a worker's death to show after a peer's collective failed.
WORKER_DEATH_GRACE_S = 0.2
#: Seconds a worker gets to exit after "shutdown" before it is terminated.
WORKER_EXIT_TIMEOUT_S = 10.0
#: Ring buffer of the step broadcast: chunk bytes and chunks. A step of 256 requests
#: with 64-block tables pickles to ~100 KB; larger ones take the queue's overflow path.
BROADCAST_CHUNK_BYTES = 1 << 20
BROADCAST_CHUNKS = 4
REPLY_CHUNK_BYTES = 1 << 20
REPLY_CHUNKS = 2


def split_cpus(cpus: list[int], world_size: int) -> list[tuple[int, ...]]:
    """Disjoint, contiguous CPU sets for ``world_size`` workers from ``cpus`` (the
    engine's affinity), as even as possible; the first sets get the remainder.

    Raises:
        ValueError: naming ``tensor_parallel_size``/``pipeline_parallel_size`` when there
            are fewer CPUs than workers.
    """
    if world_size > len(cpus):
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {world_size} workers exceed "
            f"the {len(cpus)} CPUs this engine may use (one CPU per worker at least)"
        )
    base, extra = divmod(len(cpus), world_size)
    sets, start = [], 0
    for rank in range(world_size):
        n = base + (1 if rank < extra else 0)
        sets.append(tuple(cpus[start:start + n]))
        start += n
    return sets


class _StepFuture(Future[ModelRunnerOutput]):
    """A submitted step's future: ``result()`` first reads the replies of every older
    step still uncollected, then its own (replies come back in submission order)."""

    def __init__(self, collect_oldest: Callable[[], None]) -> None:
        super().__init__()
        self._collect_oldest = collect_oldest

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        while not self.done():
            self._collect_oldest()
        return super().result(timeout)


class MultiProcExecutor(Executor):
    """One worker process per rank; steps broadcast through shared memory.

    Args:
        config: the engine's frozen configuration (``parallel.distributed_executor_backend``
            "mp").
        loaded: must be ``None``: each worker loads its own shard.

    Raises:
        ValueError: a preloaded model; more workers than CPUs (CPU) or GPUs (CUDA); a
            worker's start-up error that was a ``ValueError`` (a tensor-parallel size
            that does not divide the heads, a pipeline deeper than the layers, an unknown
            model path...), re-raised with its message.
        RuntimeError: a worker that died or failed otherwise during start-up.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if loaded is not None:
            raise ValueError(
                "distributed_executor_backend 'mp': workers load their own shards; a "
                "preloaded model runs only in-process ('uni')"
            )
        self.config = config
        par = config.parallel
        self.world_size = par.world_size
        self._procs: list[BaseProcess] = []
        self._replies: list[MessageQueue] = []
        self._reply_handles: list[Handle] = []
        self._broadcast: MessageQueue | None = None
        self._encoder = StepEncoder()
        # Submitted steps whose replies are not read yet, oldest first.
        self._in_flight: deque[_StepFuture] = deque()
        self._dead: str | None = None
        self._closed = False
        self._memfds: list[int] = []
        self._rdv_dir = tempfile.mkdtemp(prefix="tandem-dist-")
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.kv_caches: list[Any] = []
        device = config.model.device
        if device.startswith("cuda"):
            import torch

            if self.world_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} "
                    f"exceeds the {torch.cuda.device_count()} visible CUDA devices"
                )
            if config.kv_transfer.kv_connector is not None:
                raise ValueError(
                    "kv_connector: a KV connector with tensor/pipeline parallel workers is "
                    "implemented for CPU caches only (the GPU caches live in the workers)"
                )
            cpu_sets: list[tuple[int, ...] | None] = [None] * self.world_size
            backend = "nccl"
        else:
            cpu_sets = list(split_cpus(sorted(os.sched_getaffinity(0)), self.world_size))
            backend = "gloo"
        try:
            self._start_workers(cpu_sets, backend)
        except BaseException:
            self.shutdown()
            raise

    # -- start-up -------------------------------------------------------------------------

    def _start_workers(self, cpu_sets: list[tuple[int, ...] | None], backend: str) -> None:
        check_main_guard()
        ctx = multiprocessing.get_context("spawn")
        # NOTE: room for every step in flight plus one command, so submitting never
        # waits for a busy worker to read (nor a worker for the engine to collect).
        depth = self.max_concurrent_batches + 1
        self._broadcast = MessageQueue.create(self.world_size, BROADCAST_CHUNK_BYTES,
                                              max(BROADCAST_CHUNKS, depth),
                                              is_alive=self._all_alive)
        init_method = f"file://{os.path.join(self._rdv_dir, 'rendezvous')}"
        pipes = []
        for rank in range(self.world_size):
            spec = WorkerSpec(
                config=self.config, rank=rank, dist_init_method=init_method,
                dist_backend=backend, cpus=cpu_sets[rank],
                broadcast=self._broadcast.handle(),
                parent_pid=os.getpid(), log_level=logging.getLogger().getEffectiveLevel(),
                reply_chunk_bytes=REPLY_CHUNK_BYTES, reply_chunks=max(REPLY_CHUNKS, depth),
            )
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(spec, theirs), daemon=True,
                               name=f"tandem-worker-{rank}")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            pipes.append(ours)
        infos = []
        for rank, conn in enumerate(pipes):
            info = self._wait_ready(rank, conn)
            self._reply_handles.append(info["reply"])
            try:
                self._replies.append(MessageQueue.attach(info["reply"], 0,
                                                         is_alive=self._all_alive))
            except FileNotFoundError:
                self._check_alive(starting=True)
                raise
            infos.append(info)
        self.shard_infos = infos
        self._facts: ModelFacts = infos[0]["facts"]
        self._has_tokenizer = bool(infos[0]["has_tokenizer"])
        logger.info("started %d worker processes (tensor_parallel_size=%d, "
                    "pipeline_parallel_size=%d, %s)", self.world_size,
                    self.config.parallel.tensor_parallel_size,
                    self.config.parallel.pipeline_parallel_size, backend)

    def _wait_ready(self, rank: int, conn: Any) -> dict[str, Any]:
        """The start-up report of worker ``rank``; raises its error, or fails fast when
        any worker died."""
        waited = 0.0
        while not conn.poll(0.5):
            waited += 0.5
            self._check_alive(starting=True)
            if waited >= WORKER_STARTUP_TIMEOUT_S:
                raise RuntimeError(f"worker {rank} did not start within "
                                   f"{WORKER_STARTUP_TIMEOUT_S:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            self._check_alive(starting=True)
            raise RuntimeError(f"worker {rank} closed its start-up pipe without a report") from None
        finally:
            conn.close()
        if msg[0] == "error":
            _, type_name, message, tb = msg
            if type_name == "ValueError":
                # A setting the model cannot take: the message is the whole story for
                # the user; the worker's stack helps only whoever debugs tandem itself.
                logger.debug("worker %d refused its start-up:\n%s", rank, tb)
                raise ValueError(message)
            logger.error("worker %d failed to start:\n%s", rank, tb)
            raise RuntimeError(f"worker {rank} failed to start: {type_name}: {message}")
        return dict(msg[1])

    # -- liveness -------------------------------------------------------------------------

    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _check_alive(self, starting: bool = False) -> None:
        """Raise when a worker died (``EngineDeadError`` once the engine runs)."""
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                why = (f"worker process {rank} (pid {proc.pid}) died with exit code "
                       f"{proc.exitcode}")
                if starting:
                    raise RuntimeError(why)
                self._dead = why
                raise EngineDeadError(why)

    # -- commands -------------------------------------------------------------------------

    def _collective(self, *command: Any) -> list[Any]:
        """Send ``command`` to every worker and return each one's result, in rank order
        (after collecting every step still in flight).

        Raises:
            EngineDeadError: a worker died (now or before); the engine cannot go on.
            ValueError / RuntimeError: a worker's error for this command.
        """
        while self._in_flight:
            self._collect_oldest()
        self._send(command)
        return self._receive(command[0])

    def _send(self, command: tuple[Any, ...]) -> None:
        """Broadcast ``command`` to every worker.

        Raises:
            EngineDeadError: a worker died (now or before).
            RuntimeError: after ``shutdown``.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise RuntimeError("the executor is shut down")
        assert self._broadcast is not None
        try:
            self._broadcast.enqueue(command)
        except RuntimeError:
            self._check_alive()
            raise

    def _receive(self, name: str) -> list[Any]:
        """Every worker's reply to the oldest command not answered yet (``name``), in
        rank order; raises as ``_collective``."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        replies: list[Any] = [None] * self.world_size
        try:
            pending = list(range(self.world_size))
            while pending:
                # NOTE: whichever answers first: a rank that failed inside a step
                # answers at once while its peers wait in a collective for it forever.
                i, reply = dequeue_any([self._replies[r] for r in pending], self._all_alive)
                replies[pending.pop(i)] = reply
                if reply[0] == "error":
                    break
        except RuntimeError:
            self._check_alive()
            raise
        errors = [r for r in replies if r is not None and r[0] == "error"]
        if errors:
            _, type_name, message, tb = errors[0]
            logger.error("worker error in %s:\n%s", name, tb)
            # NOTE: the ranks may now disagree (one raised inside a collective, its
            # peers still wait in it) and replies still owed would answer the next
            # command: nothing later can be trusted.
            self._dead = f"a worker failed {name}: {type_name}: {message}"
            # A peer's death usually shows first as a collective's error on the
            # survivors ("connection reset"): name the dead worker when there is one.
            for proc in self._procs:
                proc.join(WORKER_DEATH_GRACE_S)
            self._check_alive()
            if name == "execute_model":
                raise EngineDeadError(self._dead)
            raise (ValueError if type_name == "ValueError" else RuntimeError)(message)
        return [r[1] for r in replies]

    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        if self._tokenizer is None and self._has_tokenizer:
            from tandem.engine.model_files import load_tokenizer

            self._tokenizer = load_tokenizer(self.config.model.model)
        return self._tokenizer

    def determine_num_blocks(self) -> int:
        # NOTE: the minimum: every rank's cache must hold the same block ids.
        return int(min(self._collective("determine_num_blocks")))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        shared = (self.config.kv_transfer.kv_connector is not None
                  and not self.config.model.device.startswith("cuda"))
        if not shared:
            self._collective("initialize_kv_cache", num_blocks, None)
            return
        self._close_memfds()
        files = []
        for rank, info in enumerate(self.shard_infos):
            fd = os.memfd_create(f"tandem-kv-rank{rank}")
            self._memfds.append(fd)
            os.ftruncate(fd, num_blocks * int(info["block_bytes"]))
            files.append(f"/proc/{os.getpid()}/fd/{fd}")
        # One broadcast carries every rank's file; each worker maps its own.
        self._collective("initialize_kv_cache", num_blocks, files)
        self.kv_caches = [self._map_cache(num_blocks, info, path)
                          for info, path in zip(self.shard_infos, files, strict=True)]

    def _map_cache(self, num_blocks: int, info: dict[str, Any], path: str) -> Any:
        from tandem.engine.model_loader import resolve_dtype
        from tandem.kernels.cache import allocate_kv_cache

        dtype = resolve_dtype(self._facts.dtype, "cpu")
        return allocate_kv_cache(num_blocks, len(info["layer_range"]), self.config.cache.block_size,
                                 len(info["kv_head_range"]), self._facts.head_dim, dtype, "cpu",
                                 shared_file=path,
                                 num_components=self._facts.kv_spec.num_components)

    def register_kv_caches(self, connector_worker: KVConnectorWorker) -> None:
        if not self.kv_caches:
            raise RuntimeError("register_kv_caches: no shared KV cache (initialize_kv_cache "
                               "first, and only a CPU engine with a connector has one)")
        from tandem.engine.kv_shards import KVShard, ShardedKVCache

        shards = [KVShard(cache, info["layer_range"], info["kv_head_range"])
                  for cache, info in zip(self.kv_caches, self.shard_infos, strict=True)]
        connector_worker.register_kv_caches(
            ShardedKVCache(shards, num_layers=self._facts.num_layers,
                           num_kv_heads=self._facts.num_kv_heads)
        )

    @property
    def max_concurrent_batches(self) -> int:
        """``pipeline_parallel_size``: one step per stage in flight."""
        return self.config.parallel.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.submit_step(scheduler_output).result()

    def submit_step(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Broadcast one step and return its future without waiting for the workers.

        Raises:
            EngineDeadError: a worker died (now or before).
            RuntimeError: after ``shutdown``, or with ``max_concurrent_batches`` steps
                already in flight (the engine core collects before submitting more).
        """
        if len(self._in_flight) >= self.max_concurrent_batches:
            raise RuntimeError(f"{len(self._in_flight)} steps in flight already "
                               f"(max_concurrent_batches {self.max_concurrent_batches})")
        msg = self._encoder.encode(scheduler_output)
        self._send(("execute_model", msg))
        future = _StepFuture(self._collect_oldest)
        self._in_flight.append(future)
        return future

    def _collect_oldest(self) -> None:
        """Read the oldest in-flight step's replies into its future. An error fails it
        and every younger step (the engine is dead then)."""
        future = self._in_flight.popleft()
        try:
            out = self._receive("execute_model")[self.driver_rank]
        except Exception as exc:
            future.set_exception(exc)
            why = self._dead or "an earlier step failed"
            while self._in_flight:
                self._in_flight.popleft().set_exception(EngineDeadError(why))
            return
        assert isinstance(out, ModelRunnerOutput), "the driver rank returns the step's output"
        future.set_result(out)

    def collective_stats(self) -> list[dict[str, dict[str, float]]]:
        """Per rank, what its ``torch.distributed`` calls cost since start-up: op name
        ("all_reduce", "gather", "send", "recv") -> ``{"calls": n, "seconds": s}``
        (wall time in the call, waiting for peers included)."""
        return list(self._collective("collective_stats"))

    @property
    def shm_segments(self) -> list[str]:
        """Names of the shared-memory segments of its queues (under ``/dev/shm``): the
        step broadcast and each worker's replies. ``shutdown`` removes them all."""
        queues = [self._broadcast.handle()] if self._broadcast is not None else []
        return [h.name for h in queues + self._reply_handles]

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, in rank order."""
        return [int(p.pid or 0) for p in self._procs]

    @property
    def driver_rank(self) -> int:
        """The rank that samples: last pipeline stage, tensor-parallel rank 0."""
        par = self.config.parallel
        return distributed.driver_rank(par.tensor_parallel_size, par.pipeline_parallel_size)

    # -- shutdown -------------------------------------------------------------------------

    def _close_memfds(self) -> None:
        self.kv_caches = []
        for fd in self._memfds:
            os.close(fd)
        self._memfds = []

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # NOTE: steps in flight are answered into the reply rings (they have room for
        # them and the shutdown reply), so no worker waits for them to be read.
        while self._in_flight:
            self._in_flight.popleft().set_exception(RuntimeError("the executor is shut down"))
        if self._broadcast is not None and self._dead is None and self._all_alive():
            try:
                self._broadcast.enqueue(("shutdown",), timeout=WORKER_EXIT_TIMEOUT_S)
            except (RuntimeError, TimeoutError):
                pass  # terminated below
        for proc in self._procs:
            proc.join(WORKER_EXIT_TIMEOUT_S if self._dead is None else 0.1)
            if proc.is_alive():
                proc.kill()  # stuck in a collective with a dead peer
                proc.join(WORKER_EXIT_TIMEOUT_S)
        for q in self._replies:
            q.close()
        for handle in self._reply_handles:
            # A worker that died (or was killed above) never unlinked its reply queue.
            MessageQueue.remove_segment(handle)
        if self._broadcast is not None:
            self._broadcast.close()
        self._close_memfds()
        shutil.rmtree(self._rdv_dir, ignore_errors=True)
