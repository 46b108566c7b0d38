"""Worker processes that each run one rank's ``ModelRunner``, for the tensor- and
pipeline-parallel tests (beside ``tiny_models.py``; ``tests/`` is on pytest's pythonpath).

``RankPool`` starts the processes once (forkserver: torch and the engine are imported
once, in the server, and every rank is forked from it) and runs named commands on a
set of ranks; a command failing on any rank raises here with that rank's traceback.
``RankExecutor`` is an ``Executor`` over such a pool: the engine core's every step goes
to every rank (the same ``SchedulerOutput``), the driver rank's output comes back, as
the multi-process executor does it (without its shared-memory broadcast).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch

from tandem.engine import distributed
from tandem.engine.config import EngineConfig
from tandem.engine.executor.abstract import Executor
from tandem.engine.model_facts import ModelFacts
from tandem.engine.model_loader import LoadedModel
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.registry import build_model, get_model_class
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.worker import Worker

# How long a rank waits in a collective for a peer (one that crashed ends the test
# with an error instead of a hang), and how long the test waits for a command.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# What every rank imports, once in the forkserver (the transformers configs: to unpickle
# the tiny models' configs).
PRELOAD = [
    "tandem.engine.model_runner",
    "tandem.engine.worker",
    "tandem.engine.models.registry",
    "tandem.engine.executor.abstract",
    *(f"transformers.models.{m}.configuration_{m}" for m in ("llama", "mistral", "qwen2", "qwen3")),
]
REPLY_TIMEOUT_S = 120.0


def _loaded(
    hf_config: Any,
    state_dict: dict[str, torch.Tensor],
    max_len: int,
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """This rank's part of the CPU model of ``hf_config`` with these weights."""
    model = build_model(hf_config, state_dict, dtype, "cpu", max_len)
    return LoadedModel(model=model, hf_config=hf_config, tokenizer=None, model_id="tiny",
                       dtype=dtype, device=torch.device("cpu"), eos_token_id=None,
                       max_position=max_len)


def _init(state: dict, rank: int, tp: int, pp: int, init_method: str) -> None:
    distributed.init_distributed(rank, tp, pp, init_method, "gloo", timeout=COLLECTIVE_TIMEOUT)


def _destroy(state: dict, rank: int) -> None:
    state.clear()
    distributed.destroy_distributed()


def _load(
    state: dict,
    rank: int,
    config: EngineConfig,
    hf_config: Any,
    weights: dict,
    max_len: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    """Build this rank's model and runner (``hf_config`` ``None``: the runner loads
    ``config.model`` itself, as a worker does); its logits (driver only) are recorded."""
    loaded = _loaded(hf_config, weights, max_len, dtype) if hf_config is not None else None
    runner = ModelRunner(config, loaded)
    state["runner"], state["logits"] = runner, []
    compute_logits = runner.model.compute_logits

    def recording(hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        logits = compute_logits(hidden, upcast)
        if logits is not None:
            state["logits"].append(logits.float().clone())
        return logits

    runner.model.compute_logits = recording
    return {
        "layer_range": runner.layer_range,
        "kv_head_range": runner.kv_head_range,
        "num_layers": runner.num_layers,
        "num_kv_heads": runner.num_kv_heads,
        "is_driver": runner.is_driver,
        "num_blocks": runner.determine_num_blocks(),
        "block_bytes": runner.block_bytes,
    }


def _facts(
    state: dict, rank: int, config: EngineConfig, hf_config: Any, weights: dict, max_len: int
) -> ModelFacts:
    """What a ``Worker`` on this rank reports (rank 0: the config is 1 x 1 here)."""
    loaded = _loaded(hf_config, weights, max_len) if hf_config is not None else None
    worker = Worker(config, rank=0, loaded=loaded)
    worker.load_model()
    return worker.model_facts()


def _init_kv(state: dict, rank: int, num_blocks: int) -> tuple[int, ...]:
    state["runner"].initialize_kv_cache(num_blocks)
    return tuple(state["runner"].kv_cache.shape)


def _step(state: dict, rank: int, sched: SchedulerOutput) -> ModelRunnerOutput:
    return state["runner"].execute_model(sched)


def _logits(state: dict, rank: int) -> list[torch.Tensor]:
    return state["logits"]


def _model_error(state: dict, rank: int, hf_config: Any) -> str:
    """The ``ValueError`` building ``hf_config``'s model on this rank raises (``""``: none)."""
    try:
        with torch.device("meta"):
            get_model_class(hf_config)(hf_config, max_position=32)
    except ValueError as e:
        return str(e)
    return ""


def _runner_error(state: dict, rank: int, config: EngineConfig) -> str:
    """The ``ValueError`` a ``ModelRunner`` for ``config`` raises here, before it loads
    anything (``""``: none)."""
    try:
        ModelRunner(config, None)
    except ValueError as e:
        return str(e)
    return ""


COMMANDS: dict[str, Callable[..., Any]] = {
    "init": _init,
    "destroy": _destroy,
    "load": _load,
    "facts": _facts,
    "init_kv": _init_kv,
    "step": _step,
    "logits": _logits,
    "model_error": _model_error,
    "runner_error": _runner_error,
}


def serve(rank: int, commands: mp.Queue, replies: mp.Queue) -> None:
    """A rank's loop: run each ``(name, args)`` command, reply ``(rank, ok, result)``;
    ``None`` ends it."""
    torch.set_num_threads(1)
    state: dict[str, Any] = {}
    while (msg := commands.get()) is not None:
        name, args = msg
        try:
            replies.put((rank, True, COMMANDS[name](state, rank, *args)))
        except BaseException:
            replies.put((rank, False, traceback.format_exc()))
    distributed.destroy_distributed()


class RankError(RuntimeError):
    """A command failed on a rank (the message carries its traceback)."""


class RankPool:
    """``size`` rank processes, forked from a forkserver that imported the engine.

    ``close`` stops and joins the ranks; the forkserver itself is the standard
    library's one per process and ends when the test process does.

    Raises:
        RankError: from ``call``, when a rank fails a command or does not answer in
            ``REPLY_TIMEOUT_S``; the pool is then ``broken`` (close it).
    """

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("forkserver")
        # Modules of the installed package only: Python 3.11's forkserver imports its
        # preloads before it applies the parent's sys.path (tests/ is not on it yet).
        ctx.set_forkserver_preload(PRELOAD)
        self.replies: mp.Queue = ctx.Queue()
        self.commands: list[mp.Queue] = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(target=serve, args=(r, self.commands[r], self.replies), daemon=True)
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def call(self, ranks: Iterable[int], name: str, *args: Any) -> dict[int, Any]:
        """Run command ``name`` with ``args`` on every rank of ``ranks`` at once;
        rank -> its result."""
        ranks = list(ranks)
        for r in ranks:
            self.commands[r].put((name, args))
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(results) + len(errors) < len(ranks):
                rank, ok, value = self.replies.get(timeout=REPLY_TIMEOUT_S)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        except queue.Empty:
            errors.append(f"no reply to {name!r} from ranks {set(ranks) - set(results)}")
        if errors:
            self.broken = True
            raise RankError("\n".join(errors))
        return results

    def close(self) -> None:
        """Stop every rank (terminate those that do not stop) and wait for them."""
        for q, p in zip(self.commands, self.procs, strict=True):
            if p.is_alive() and not self.broken:
                q.put(None)
        for p in self.procs:
            p.join(timeout=None if not self.broken else 10)
            if p.is_alive():
                p.terminate()
                p.join()
        for q in [*self.commands, self.replies]:
            q.close()
            q.join_thread()


class RankExecutor(Executor):
    """The engine core's executor over ranks ``0 .. tp * pp - 1`` of ``pool``, whose
    process group is already initialised (``"init"``).

    Loads ``hf_config`` with ``weights`` on every rank; ``model_facts`` come from a
    ``Worker`` on rank 0, the block count is the minimum over the ranks. Checks on every
    step that only the driver rank returned an output.
    """

    def __init__(
        self,
        pool: RankPool,
        tp: int,
        pp: int,
        config: EngineConfig,
        hf_config: Any,
        weights: dict[str, torch.Tensor],
        max_len: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.pool, self.ranks = pool, range(tp * pp)
        self.driver = distributed.driver_rank(tp, pp)
        self.infos = pool.call(self.ranks, "load", config, hf_config, weights, max_len, dtype)
        self._facts = pool.call([0], "facts", config, hf_config, weights, max_len)[0]
        self.kv_shapes: dict[int, tuple[int, ...]] = {}

    @property
    def model_facts(self) -> ModelFacts:
        return self._facts

    @property
    def tokenizer(self) -> None:
        return None

    def determine_num_blocks(self) -> int:
        return min(info["num_blocks"] for info in self.infos.values())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_shapes = self.pool.call(self.ranks, "init_kv", num_blocks)

    def register_kv_caches(self, connector_worker: Any) -> None:
        raise NotImplementedError("no KV connector in these tests")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        outs = self.pool.call(self.ranks, "step", scheduler_output)
        for rank, out in outs.items():
            if rank != self.driver:
                assert out == ModelRunnerOutput(), f"rank {rank} is not the driver: {out}"
        return outs[self.driver]

    def driver_logits(self) -> list[torch.Tensor]:
        """The logits the driver computed, one ``[rows, vocab]`` float32 per call."""
        return self.pool.call([self.driver], "logits")[self.driver]

    def shutdown(self) -> None:
        pass
