"""One worker process of the multi-process executor: its entry point and command loop.

The executor starts ``worker_main`` once per rank (``multiprocessing`` "spawn": a fresh
interpreter, no fork of the engine's threads). The process pins itself to its CPUs,
joins the ``torch.distributed`` group, loads its shard of the model and reports
ready (or the error that stopped it) through its start-up pipe. Then it serves the
executor's commands, which arrive in order on the shared-memory broadcast queue, and
answers each on its own reply queue:

    ("determine_num_blocks",)             -> int, this rank's budget
    ("initialize_kv_cache", n, files)     -> None (``files[rank]``: the shared cache to map,
                                             or ``files`` None: a private cache)
    ("execute_model", StepMessage)        -> ModelRunnerOutput on the driver rank, else None
    ("collective_stats",)                 -> this rank's ``distributed.collective_stats()``
    ("shutdown",)                         -> None, then the process exits

A reply is ``("ok", value)`` or ``("error", type_name, message, traceback)``. The
process exits by itself when its parent dies (it checks while waiting).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tandem.engine.config import EngineConfig
from tandem.engine.executor.shm_broadcast import Handle, MessageQueue
from tandem.engine.executor.step_message import RequestMirror

if TYPE_CHECKING:
    from tandem.engine.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process is started with (pickled to the new process).

    Attributes:
        config: the engine's frozen configuration.
        rank: global rank, ``pp_rank * tensor_parallel_size + tp_rank``.
        dist_init_method: ``torch.distributed`` rendezvous URL, the same for all ranks.
        dist_backend: "gloo" (CPU) or "nccl" (CUDA).
        cpus: CPUs to pin to (``None``: keep the inherited affinity).
        broadcast: handle of the executor's command queue.
        parent_pid: the engine process; the worker exits when it is gone.
        log_level: the engine's logging level.
        reply_chunk_bytes / reply_chunks: the ring of the worker's reply queue.
    """

    config: EngineConfig
    rank: int
    dist_init_method: str
    dist_backend: str
    cpus: tuple[int, ...] | None
    broadcast: Handle
    parent_pid: int
    log_level: int = logging.INFO
    reply_chunk_bytes: int = 1 << 20
    reply_chunks: int = 2


def _config_for_rank(config: EngineConfig) -> EngineConfig:
    """The config a rank's worker runs: on CUDA, the device ``init_distributed`` made
    this process's current one (its rule maps ranks to GPUs), whatever index the
    engine's ``--device`` named. Call after ``init_distributed``."""
    if not config.model.device.startswith("cuda"):
        return config
    import torch

    model = dataclasses.replace(config.model, device=f"cuda:{torch.cuda.current_device()}")
    return dataclasses.replace(config, model=model)


def _error(exc: BaseException) -> tuple[str, str, str, str]:
    return ("error", type(exc).__name__, str(exc), traceback.format_exc())


def _run_command(worker: Worker, command: tuple, mirror: RequestMirror, rank: int) -> Any:
    """Run one executor command on ``worker``; its result (``None`` for commands without
    one, and for ``execute_model`` on a rank that is not the driver).

    Raises:
        ValueError: an unknown command name; whatever the command raises.
    """
    from tandem.engine import distributed

    name = command[0]
    if name == "determine_num_blocks":
        return worker.determine_num_blocks()
    if name == "initialize_kv_cache":
        files = command[2]
        worker.initialize_kv_cache(command[1], None if files is None else files[rank])
        return None
    if name == "execute_model":
        out = worker.execute_model(mirror.decode(command[1]))
        return out if worker.is_driver else None
    if name == "collective_stats":
        return distributed.collective_stats()
    if name == "shutdown":
        worker.shutdown()
        return None
    raise ValueError(f"unknown worker command {name!r}")


def worker_main(spec: WorkerSpec, startup: Connection) -> None:
    """Entry point of a worker process (see the module docstring).

    Errors before "ready" go to ``startup`` as an error reply and end the process;
    errors of a command go back as its error reply, and the process keeps serving
    (the executor decides whether the engine can go on).
    """
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s worker-{spec.rank} %(levelname)s %(name)s: %(message)s")
    import torch

    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(len(spec.cpus))
    from tandem.engine import distributed
    from tandem.engine.worker import Worker

    par = spec.config.parallel

    def parent_alive() -> bool:
        return os.getppid() == spec.parent_pid

    try:
        commands = MessageQueue.attach(spec.broadcast, reader_rank=spec.rank,
                                       is_alive=parent_alive)
        distributed.init_distributed(spec.rank, par.tensor_parallel_size,
                                     par.pipeline_parallel_size, spec.dist_init_method,
                                     spec.dist_backend,
                                     enable_expert_parallel=par.enable_expert_parallel)
        worker = Worker(_config_for_rank(spec.config), rank=spec.rank)
        worker.load_model()
        info = worker.shard_info()
        # This worker writes its replies; the executor removes the segment if the
        # worker dies without closing it.
        reply = MessageQueue.create(1, spec.reply_chunk_bytes, spec.reply_chunks,
                                    is_alive=parent_alive)
        info["reply"] = reply.handle()
    except BaseException as exc:  # noqa: BLE001 - reported to the executor, which raises it
        startup.send(_error(exc))
        startup.close()
        distributed.destroy_distributed()
        return
    startup.send(("ready", info))
    startup.close()

    mirror = RequestMirror()
    try:
        while True:
            try:
                command = commands.dequeue()
            except RuntimeError:
                logger.warning("the engine process is gone: worker %d exits", spec.rank)
                return
            name = command[0]
            try:
                reply.enqueue(("ok", _run_command(worker, command, mirror, spec.rank)))
            except Exception as exc:  # noqa: BLE001 - the executor raises it in the engine
                if not parent_alive():
                    return
                reply.enqueue(_error(exc))
            if name == "shutdown":
                return
    finally:
        commands.close()
        reply.close()
        distributed.destroy_distributed()
