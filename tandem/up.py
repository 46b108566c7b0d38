"""`tandem up`: the whole pipeline on one machine, as child processes.

Disaggregated (default): redis-server (unless ``--redis-url``), one KV store node,
``--prefill N`` prefill and ``--decode M`` decode services, and the router.
``--colocated [--replicas K]``: K engines in the colocated role (no store) behind the same
router. ``--device cuda[:N]`` puts every engine on that GPU; engines that share a GPU split
``--gpu-memory-utilization`` between them and start one after another (each sizes its KV
cache from its own share, measured while the others stand still). Waits until every part
reports healthy, prints the URLs, then supervises: a part
that exits is started again with backoff while the rest keeps serving
(``tandem.supervise``), and each event is printed. On Ctrl-C or SIGTERM it stops
everything: the children share one process group that is terminated (then killed), each
child also gets SIGTERM from the kernel if this process dies (``PR_SET_PDEATHSIG``, set by
``tandem/child.py`` before it execs the part), and the temporary directory (redis working
dir) is removed. The children's logs go to ``--log-dir`` (``tandem-logs`` in the working
directory), one ``<part>.log`` each, rotated when a part starts again, and are kept.

:class:`Stack` is the same thing as a context manager, used by ``tandem.demo``, the
benchmarks and the end-to-end tests; it decides what to start and ``tandem.launch`` starts,
waits for and stops it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.contracts.role import Role
from tandem.contracts.tracing import TracingConfig, add_tracing_flags
from tandem.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
from tandem.kvstore.config import parse_bytes
from tandem.kvstore.disk_scan import probe_directory
from tandem.launch import (
    Launcher,
    Part,
    StackError,
    free_port,
    grpc_serving,
    http_ok,
    redis_ok,
    tandem_argv,
)
from tandem.stack_plan import (
    CPU_TURNS_FILE,
    TURNS_MAX_NUM_BATCHED_TOKENS,
    engines_share_a_gpu,
    gpu_memory_utilization_args,
    kv_cache_args,
    parts_env,
    sets_flag,
    takes_cpu_turns,
)
from tandem.supervise import Supervisor


def banner(stack: Stack, mode: str) -> str:
    """What ``tandem up`` prints once every part is ready: where to reach what."""
    return (f"\ntandem is up ({mode}):\n"
            f"  OpenAI API   {stack.http_url}/v1   (curl {stack.http_url}/v1/models)\n"
            f"  gRPC         {stack.grpc_address}   (tandem.v1.GenerationService)\n"
            f"  metrics      {stack.http_url}/metrics\n"
            + "".join(f"  {name + ' metrics':<12} {url}\n"
                      for name, url in stack.engine_metrics_urls.items())
            + f"  redis        {stack.redis_url}\n"
            + (f"  KV store     {stack.kvstore_metrics_url}\n" if stack.kvstore_metrics_url
               else "")
            + ("" if stack.config.verbose
               else f"  logs         {stack.log_dir}   (<part>.log; .1 .. .5 earlier runs)\n"
               if stack.config.log_dir is not None
               else f"  logs         {stack.log_dir}   (removed on exit)\n")
            + "Press Ctrl-C to stop.")


@dataclass
class StackConfig:
    """What to start. Ports of 0 are picked free at start.

    Attributes:
        num_prefill / num_decode: disaggregated instance counts.
        colocated: run ``replicas`` colocated engines instead.
        port / grpc_port: router HTTP and gRPC ports.
        model: model path (``None``: the default model).
        redis_url: use this Redis instead of starting one.
        engine_args: extra flags for every engine (``--dtype float32``...).
        prefill_engine_args / decode_engine_args: extra flags for the prefill / decode
            engines only, after ``engine_args`` (so they win where both set a flag);
            disaggregated stacks only.
        router_args: extra flags for the router.
        speculative_config: ``--speculative-config`` JSON for the engines that decode
            (decode and colocated; prefill samples one token, nothing to speculate on).
        engine_metrics: give each engine a Prometheus ``/metrics`` port
            (``Stack.engine_metrics_urls``: the engines' step, KV cache, store-lookup and
            ``spec_decode_*`` series; the router's ``/metrics`` has only its own).
        kvstore_capacity_bytes: KV store node memory.
        kvstore_disk_path / kvstore_disk_capacity_bytes: the store node's disk tier
            (`tandem kvstore --disk-path/--disk-capacity`); ``None``: RAM only.
        cpus_per_engine: pin engine i to its own CPU set of this size (0: no pinning).
        cpu_turns: unpinned CPU engines take turns for each model step
            (:func:`takes_cpu_turns`); ``False``: they run their steps at the same time.
        startup_timeout_s: how long every part gets to become healthy.
        gpu_memory_utilization: the fraction of one GPU's total memory that the engines
            sharing it take together, split evenly between them
            (:func:`gpu_memory_utilization_args`); an engine alone on its GPU takes it
            whole.
        verbose: children write to this terminal instead of log files.
        log_dir: folder for the children's logs, kept after the stack stops (``None``:
            the stack's temporary folder, removed with it).
        tracing_args: ``--otlp-traces-endpoint`` / ``--otlp-traces-protocol`` as given,
            passed to every part (router, engines, store node; ``contracts/tracing.py``).
    """

    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    replicas: int = 1
    port: int = 8000
    grpc_port: int = 50051
    host: str = "127.0.0.1"
    model: str | None = None
    redis_url: str | None = None
    engine_args: list[str] = field(default_factory=list)
    prefill_engine_args: list[str] = field(default_factory=list)
    decode_engine_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    speculative_config: str | None = None
    engine_metrics: bool = False
    kvstore_capacity_bytes: int = 1 << 30
    kvstore_disk_path: str | None = None
    kvstore_disk_capacity_bytes: int = 0
    cpus_per_engine: int = 0
    cpu_turns: bool = True
    startup_timeout_s: float = 600.0
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    verbose: bool = False
    log_dir: Path | None = None
    tracing_args: list[str] = field(default_factory=list)


def _preflight(cfg: StackConfig) -> None:
    """Checks that need no child process, so a mistake fails at once (not after every
    engine loaded its weights for a minute).

    Raises:
        StackError: a router port is in use, or ``--model`` does not exist.
    """
    for flag, port in (("--port", cfg.port), ("--grpc-port", cfg.grpc_port)):
        if not port:
            continue  # 0: a free one is picked
        with socket.socket() as s:
            # As uvicorn does: a port left in TIME_WAIT by a stack just stopped is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cfg.host, port))
            except OSError as exc:
                raise StackError(f"{flag} {port}: {cfg.host}:{port} is in use or cannot be "
                                 f"bound ({exc.strerror}); pass another {flag} (0 picks a "
                                 "free one)") from exc
    if cfg.model and not Path(cfg.model).exists():
        raise StackError(f"--model {cfg.model}: no such file or folder (a local Hugging Face "
                         "folder or .gguf file; nothing is downloaded)")


class Stack:
    """Start the parts of ``config`` as child processes; ``close()`` stops them all.

    Usage: ``with Stack(StackConfig(...)) as stack: stack.http_url ...``.

    Raises:
        StackError: a binary is missing, a part exits early or is not healthy in time.
    """

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.tmpdir: Path | None = None
        self._launcher: Launcher | None = None
        self.redis_url = config.redis_url or ""
        self.http_url = ""
        self.grpc_address = ""
        self.kvstore_metrics_url = ""  # set when a KV store node is started
        #: engine name -> its /metrics URL (``StackConfig.engine_metrics``).
        self.engine_metrics_urls: dict[str, str] = {}
        self.log_dir: Path | None = None  # None: the children log to this terminal
        self._cpu_next = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        cfg = self.config
        _preflight(cfg)
        self.tmpdir = Path(tempfile.mkdtemp(prefix="tandem-up-"))
        env = parts_env(cfg, os.environ)
        if not cfg.verbose:
            self.log_dir = cfg.log_dir if cfg.log_dir is not None else self.tmpdir
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._launcher = Launcher(self.log_dir, env)
        if not self.redis_url:
            binary = shutil.which("redis-server")
            if binary is None:
                raise StackError("redis-server not found on PATH: install it (e.g. `apt-get "
                                 "install redis-server`, `brew install redis`) or pass "
                                 "--redis-url redis://HOST:PORT")
            port = free_port()
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            self._launch([Part("redis", [binary, "--port", str(port), "--bind", "127.0.0.1",
                                         "--save", "", "--appendonly", "no",
                                         "--dir", str(self.tmpdir)],
                               lambda u=self.redis_url: redis_ok(u), self.redis_url)])
        engines: list[Part] = []
        if cfg.colocated:
            for i in range(cfg.replicas):
                engines.append(self._engine_part(f"colocated-{i}", ["serve", "--role", Role.BOTH.value,
                                                                    *self._spec_args()]))
        else:
            kv_port, kv_metrics = free_port(), free_port()
            self.kvstore_metrics_url = f"http://127.0.0.1:{kv_metrics}/metrics"
            self._launch([Part("kvstore", tandem_argv(
                "kvstore", "--listen", f"127.0.0.1:{kv_port}", "--capacity",
                str(cfg.kvstore_capacity_bytes), "--redis-url", self.redis_url,
                "--metrics-port", str(kv_metrics), *cfg.tracing_args,
                *(["--disk-path", cfg.kvstore_disk_path, "--disk-capacity",
                   str(cfg.kvstore_disk_capacity_bytes)] if cfg.kvstore_disk_path else [])),
                lambda p=kv_metrics: http_ok(f"http://127.0.0.1:{p}/health"),
                f"127.0.0.1:{kv_port}")])
            for i in range(cfg.num_prefill):
                engines.append(self._engine_part(f"prefill-{i}", ["prefill"],
                                                 kvstore=f"127.0.0.1:{kv_port}"))
            for i in range(cfg.num_decode):
                engines.append(self._engine_part(f"decode-{i}", ["decode", *self._spec_args()],
                                                 kvstore=f"127.0.0.1:{kv_port}"))
        if engines_share_a_gpu(cfg):
            # NOTE: an engine's memory profile charges it the device memory that rose
            # while it profiled; engines sharing a GPU profile one after another, so
            # none is charged another's weights.
            for engine in engines:
                self._launch([engine])
        else:
            self._launch(engines)
        port = cfg.port or free_port()
        grpc_port = cfg.grpc_port or free_port()
        router_argv = ["router", "--host", cfg.host, "--port", str(port), "--grpc-port",
                       str(grpc_port), "--redis-url", self.redis_url, *cfg.tracing_args,
                       *cfg.router_args]
        if cfg.model:
            router_argv += ["--model", cfg.model]
        self.http_url = f"http://{cfg.host}:{port}"
        self.grpc_address = f"{cfg.host}:{grpc_port}"
        self._launch([Part("router", tandem_argv(*router_argv),
                           lambda u=self.http_url: http_ok(f"{u}/ready"), self.http_url)])

    def _spec_args(self) -> list[str]:
        spec = self.config.speculative_config
        return ["--speculative-config", spec] if spec else []

    def _engine_part(self, name: str, cmd: list[str], kvstore: str | None = None) -> Part:
        cfg = self.config
        role_args = {"prefill": cfg.prefill_engine_args,
                     "decode": cfg.decode_engine_args}.get(cmd[0], [])
        extra = [*cfg.engine_args, *role_args]
        port = free_port()
        # NOTE: a random suffix keeps registry keys apart when stacks share one Redis.
        instance_id = f"{name}-{uuid.uuid4().hex[:8]}"
        # KV events on, so the routers route on what the engines hold (an
        # --engine-arg=--no-kv-events comes later and wins)
        argv = [*cmd, "--listen", f"127.0.0.1:{port}", "--redis-url", self.redis_url,
                "--instance-id", instance_id, "--kv-events", *kv_cache_args(cfg),
                *cfg.tracing_args, *gpu_memory_utilization_args(cfg, extra), *extra]
        if takes_cpu_turns(cfg):
            if not sets_flag(extra, "--shared-cpu-lock"):
                assert self.tmpdir is not None, "start() creates the temp dir first"
                argv += ["--shared-cpu-lock", str(self.tmpdir / CPU_TURNS_FILE)]
            if not sets_flag(extra, "--max-num-batched-tokens"):
                argv += ["--max-num-batched-tokens", str(TURNS_MAX_NUM_BATCHED_TOKENS)]
        if kvstore:
            argv += ["--kvstore", kvstore]
        if cfg.engine_metrics:
            metrics_port = free_port()
            self.engine_metrics_urls[name] = f"http://127.0.0.1:{metrics_port}/metrics"
            argv += ["--metrics-port", str(metrics_port)]
        if cfg.model:
            argv += ["--model", cfg.model]
        cpus = None
        if cfg.cpus_per_engine:
            ncpu = os.cpu_count() or 1
            cpus = [(self._cpu_next + j) % ncpu for j in range(cfg.cpus_per_engine)]
            self._cpu_next += cfg.cpus_per_engine
        return Part(name, tandem_argv(*argv), lambda a=f"127.0.0.1:{port}": grpc_serving(a),
                    f"127.0.0.1:{port}", cpus=cpus)

    def _launch(self, parts: Sequence[Part]) -> None:
        """Start ``parts`` together, then wait until each is ready (or fail)."""
        assert self._launcher is not None, "start() creates the launcher first"
        self._launcher.launch(parts, self.config.startup_timeout_s)

    @property
    def launcher(self) -> Launcher:
        """The launcher of the started parts (``start()`` first)."""
        assert self._launcher is not None, "start() first"
        return self._launcher

    @property
    def parts(self) -> list[Part]:
        """Every part started, in start order."""
        return self._launcher.parts if self._launcher is not None else []

    def dead_parts(self) -> list[Part]:
        """Parts whose process has exited."""
        return self._launcher.dead_parts() if self._launcher is not None else []

    def part(self, name: str) -> Part:
        """The part called ``name`` (StopIteration when there is none)."""
        return next(p for p in self.parts if p.name == name)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every part (``Launcher.close``: newest tier first, then the whole process
        group) and remove the temp dir."""
        if self._launcher is not None:
            self._launcher.close(timeout_s)
            self._launcher = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


#: How often ``tandem up`` looks at its children (seconds).
SUPERVISION_INTERVAL_S = 0.5


def raise_on_sigterm() -> None:
    """Turn SIGTERM and SIGINT into ``KeyboardInterrupt`` so ``with Stack(...)`` blocks
    clean up.

    SIGINT is set explicitly: a process started in the background of a non-interactive
    shell (``tandem up &`` in a script) inherits SIGINT ignored, and Python keeps an
    inherited SIG_IGN, so ``kill -INT`` / Ctrl-C would otherwise do nothing.
    """

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem up", description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--colocated", action="store_true",
                   help="colocated engines (prefill+decode in one) instead of disaggregated")
    p.add_argument("--replicas", type=int, default=1, help="colocated engines (--colocated)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="router gRPC port")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None,
                   help="cpu | cuda | cuda:N for every engine (default: the engine's, cpu); "
                        "an --engine-arg=--device=... after it wins")
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=DEFAULT_GPU_MEMORY_UTILIZATION, metavar="FRACTION",
                   help="the fraction of one GPU's total memory that the engines on it take "
                        "together, split evenly (vLLM's flag; default 0.9: 0.45 each for a "
                        "prefill and a decode engine on one GPU); an "
                        "--engine-arg=--gpu-memory-utilization=... sets one engine's own")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--kvstore-capacity", type=parse_bytes, default=1 << 30, help="KV store bytes")
    p.add_argument("--kvstore-disk-path", default=None,
                   help="directory of the KV store's disk tier (default: RAM only)")
    p.add_argument("--kvstore-disk-capacity", type=parse_bytes, default=0,
                   help="bytes the KV store's disk tier may take (K/M/G/T[iB] accepted)")
    p.add_argument("--cpus-per-engine", type=int, default=0,
                   help="pin each engine to its own N CPUs (0: no pinning)")
    p.add_argument("--cpu-turns", action=argparse.BooleanOptionalAction, default=True,
                   help="unpinned CPU engines take turns for each model step, so two "
                        "OpenMP teams never share the cores (default on; a long prefill "
                        "step then delays the decode engine's next step, as it would in "
                        "one colocated engine)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra flag for every engine, e.g. --engine-arg=--dtype=float32")
    p.add_argument("--prefill-engine-arg", action="append", default=[],
                   help="extra flag for the prefill engines only, after --engine-arg, e.g. "
                        "--prefill-engine-arg=--max-num-batched-tokens=1024")
    p.add_argument("--decode-engine-arg", action="append", default=[],
                   help="extra flag for the decode engines only, after --engine-arg, e.g. "
                        "--decode-engine-arg=--max-num-seqs=128")
    p.add_argument("--router-arg", action="append", default=[],
                   help="extra flag for the router, e.g. --router-arg=--api-key=KEY")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding on the decode (or colocated) engines, "
                        "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--verbose", action="store_true", help="children log to this terminal")
    p.add_argument("--log-dir", type=Path, default=Path("tandem-logs"),
                   help="folder for the children's logs, kept after exit; a part's previous "
                        "logs are rotated to <part>.log.1 .. .5 (default: ./tandem-logs)")
    add_tracing_flags(p)  # every part exports its spans there
    return p


def config_from_args(ns: argparse.Namespace) -> StackConfig:
    if ns.prefill < 1 or ns.decode < 1 or ns.replicas < 1:
        raise ValueError("--prefill, --decode and --replicas must be >= 1")
    if ns.colocated and (ns.prefill_engine_arg or ns.decode_engine_arg):
        raise ValueError("--prefill-engine-arg / --decode-engine-arg: a colocated stack has "
                         "no prefill or decode engines; use --engine-arg")
    if not 0.0 < ns.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {ns.gpu_memory_utilization}")
    if ns.speculative_config is not None:
        from tandem.engine.config import SpeculativeConfig

        SpeculativeConfig.from_json(ns.speculative_config)  # fail here, not in a child
    TracingConfig.from_args(ns, {}, "tandem")  # a bad endpoint fails here, not in a child
    for flag, v, lo, hi in (("--port", ns.port, 0, 65535), ("--grpc-port", ns.grpc_port, 0, 65535),
            ("--cpus-per-engine", ns.cpus_per_engine, 0, 1 << 20), ("--kvstore-capacity",
            ns.kvstore_capacity, 1, 1 << 62)):  # not a traceback or a child's error mid-start
        if not lo <= v <= hi:
            raise ValueError(f"{flag} must be in [{lo}, {hi}], got {v}")
    if (ns.kvstore_disk_path is None) != (ns.kvstore_disk_capacity == 0):
        raise ValueError("--kvstore-disk-path and --kvstore-disk-capacity go together")
    if ns.kvstore_disk_path is not None:
        probe_directory(Path(ns.kvstore_disk_path), ns.kvstore_disk_capacity, "--kvstore-")
    tracing_args = [f for flag, value in (("--otlp-traces-endpoint", ns.otlp_traces_endpoint),
                                          ("--otlp-traces-protocol", ns.otlp_traces_protocol))
                    if value for f in (flag, value)]
    return StackConfig(num_prefill=ns.prefill, num_decode=ns.decode, colocated=ns.colocated,
                       replicas=ns.replicas, port=ns.port, grpc_port=ns.grpc_port,
                       host=ns.host, model=ns.model, redis_url=ns.redis_url,
                       engine_args=([] if ns.device is None else ["--device", ns.device])
                       + list(ns.engine_arg),
                       prefill_engine_args=list(ns.prefill_engine_arg),
                       decode_engine_args=list(ns.decode_engine_arg),
                       router_args=list(ns.router_arg),
                       speculative_config=ns.speculative_config,
                       kvstore_capacity_bytes=ns.kvstore_capacity,
                       kvstore_disk_path=ns.kvstore_disk_path,
                       kvstore_disk_capacity_bytes=ns.kvstore_disk_capacity,
                       cpus_per_engine=ns.cpus_per_engine, cpu_turns=ns.cpu_turns,
                       startup_timeout_s=ns.startup_timeout,
                       gpu_memory_utilization=ns.gpu_memory_utilization,
                       verbose=ns.verbose, log_dir=ns.log_dir, engine_metrics=True,
                       tracing_args=tracing_args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem up`: start, print URLs, restart parts that exit until
    Ctrl-C/SIGTERM, stop."""
    ns = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ValueError as exc:
        print(f"tandem up: error: {exc}", file=sys.stderr)
        return 2
    raise_on_sigterm()
    stack = Stack(cfg)
    try:
        mode = (f"colocated x{cfg.replicas}" if cfg.colocated
                else f"{cfg.num_prefill} prefill + {cfg.num_decode} decode")
        print(f"tandem up: starting {mode} (model: {cfg.model or 'SmolLM2-135M-Instruct'}) ...",
              flush=True)
        stack.start()
        print(banner(stack, mode), flush=True)
        supervisor = Supervisor(stack.launcher, cfg.startup_timeout_s)
        while True:
            for line in supervisor.poll():
                print(line, file=sys.stderr, flush=True)
            time.sleep(SUPERVISION_INTERVAL_S)
    except StackError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntandem up: stopping ...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack.close()


if __name__ == "__main__":
    sys.exit(main())
