"""Starting the stack's parts as child processes: ports, health probes, waits, stopping.

One module for every launcher: ``tandem up`` (``tandem.up.Stack``), the benchmarks
(``bench/latency.py``) and the test harnesses (``tests/integration/services_harness.py``)
build :class:`Part` values and start, wait for and stop them here.

* :func:`start_part` starts one part (its log in a file, or this terminal);
* :func:`wait_ready` polls each part's readiness probe until all are ready, and fails
  at once, with the end of its log, when one exits first;
* :func:`stop_parts` sends SIGTERM, waits, then SIGKILLs what is left;
* :class:`Launcher` keeps tiers of parts started together and stops them newest first,
  in one process group, so nothing outlives it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.child import spawn

#: How often readiness probes are polled while parts start.
READY_POLL_S = 0.2
#: Earlier logs of a part kept beside its current one (``<name>.log.1`` is the newest).
KEPT_LOGS = 5


class StackError(RuntimeError):
    """A part of the stack failed to start or died."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it
    before the caller binds, so a caller that can bind port 0 itself should)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tandem_argv(*args: str) -> list[str]:
    """The command line of ``tandem ARGS...`` run by this interpreter (``-P``: the working
    directory is not put on ``sys.path``, so a checkout's folders never shadow the package)."""
    return [sys.executable, "-P", "-m", "tandem.cli", *args]


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """GET ``url`` answers 200 (connection errors and other statuses: False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def grpc_serving(address: str, timeout_s: float = 2.0, credentials: Any = None) -> bool:
    """``address`` answers the gRPC health check with SERVING (over TLS with
    ``credentials``, a ``grpc.ChannelCredentials``)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with (grpc.secure_channel(address, credentials) if credentials is not None
              else grpc.insecure_channel(address)) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=timeout_s)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def redis_ok(url: str, timeout_s: float = 2.0) -> bool:
    """The Redis at ``url`` answers PING."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


@dataclass
class Part:
    """One child process.

    Attributes:
        name: for logs and errors (also the log file's stem).
        argv: its command line.
        ready: readiness probe, called repeatedly until it returns True (must not block
            for long: each call is one poll).
        url: where to reach it (for banners).
        cpus: CPU ids to pin it to (``None``: no pinning).
        proc / log_path: set by :func:`start_part`.
    """

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    url: str = ""
    cpus: list[int] | None = None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, num_lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def start_part(part: Part, *, log_path: Path | None, env: Mapping[str, str] | None = None,
               cwd: Path | None = None, process_group: int | None = None) -> subprocess.Popen:
    """Start ``part`` (sets ``part.proc`` and ``part.log_path``) and return its process.

    It is started through ``tandem.child``: it gets SIGTERM when the calling thread dies,
    so start it from a thread that lives as long as it should.

    Args:
        log_path: file for its stdout and stderr (``None``: this process's terminal).
        env: its whole environment (``None``: this process's).
        process_group: join this group (``0``: lead a new one; ``None``: stay in ours).

    Raises:
        OSError: the command cannot be started.
    """
    out: int | object | None = None
    if log_path is not None:
        rotate_log(log_path)
        out = log_path.open("wb")
    kwargs: dict[str, object] = dict(stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    if process_group is not None:
        kwargs["process_group"] = process_group
    try:
        # No preexec_fn: it would fork() after gRPC use here (see tandem/child.py).
        part.proc = spawn(part.argv, part.cpus, **kwargs)
    finally:
        if log_path is not None and hasattr(out, "close"):
            out.close()  # the child holds its own descriptor
    part.log_path = log_path
    return part.proc


def rotate_log(path: Path, keep: int = KEPT_LOGS) -> None:
    """Move ``path`` to ``path.1`` (``.1`` to ``.2``, ...; the oldest past ``keep`` is
    removed), so that a part started again, or a new run in the same folder, writes a fresh
    log and the previous ones stay readable."""
    if not path.exists():
        return
    oldest = path.with_name(f"{path.name}.{keep}")
    oldest.unlink(missing_ok=True)
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            older.rename(path.with_name(f"{path.name}.{i + 1}"))
    path.rename(path.with_name(f"{path.name}.1"))


def wait_ready(parts: Sequence[Part], timeout_s: float) -> None:
    """Poll each part's probe until all are ready.

    Raises:
        StackError: a part exited first (its code and log tail), or ``timeout_s`` passed
            (the names of those not ready and the first one's log tail).
    """
    deadline = time.monotonic() + timeout_s
    pending = list(parts)
    while pending:
        for part in list(pending):
            assert part.proc is not None, f"{part.name}: start_part() first"
            if part.proc.poll() is not None:
                raise StackError(f"{part.name} exited with code {part.proc.returncode} "
                                 f"during start-up:\n{part.log_tail()}")
            if part.ready():
                pending.remove(part)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise StackError(f"not healthy after {timeout_s:.0f} s: {names}\n"
                             f"{pending[0].log_tail()}")
        if pending:
            time.sleep(READY_POLL_S)


def _terminate(parts: Sequence[Part], timeout_s: float) -> list[subprocess.Popen]:
    """SIGTERM every live part and wait up to ``timeout_s`` for all; returns those still
    running."""
    alive = [p.proc for p in parts if p.proc is not None and p.proc.poll() is None]
    for proc in alive:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    return [proc for proc in alive if proc.poll() is None]


def stop_parts(parts: Sequence[Part], timeout_s: float) -> None:
    """SIGTERM every live part, wait up to ``timeout_s`` for all, SIGKILL what is left."""
    for proc in _terminate(parts, timeout_s):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


class Launcher:
    """Parts started in tiers, all in one process group, stopped newest tier first.

    Args:
        log_dir: folder for one ``<name>.log`` per part (``None``: this terminal).
        env: the parts' environment (``None``: this process's).
    """

    def __init__(self, log_dir: Path | None, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = env
        self.parts: list[Part] = []
        self._tiers: list[list[Part]] = []  # parts started together, in start order
        self._pgid: int | None = None

    def launch(self, parts: Sequence[Part], timeout_s: float) -> None:
        """Start ``parts`` together, then wait until each is ready.

        Raises:
            StackError: as :func:`wait_ready`; the parts started stay owned by this
                launcher (``close`` stops them).
        """
        self._tiers.append(list(parts))
        for part in parts:
            log = self.log_dir / f"{part.name}.log" if self.log_dir is not None else None
            proc = start_part(part, log_path=log, env=self.env,
                              process_group=self._pgid or 0)
            if self._pgid is None:
                self._pgid = proc.pid
            self.parts.append(part)
        wait_ready(parts, timeout_s)

    def dead_parts(self) -> list[Part]:
        """Parts whose process has exited."""
        return [p for p in self.parts if p.proc is not None and p.proc.poll() is not None]

    def restart(self, part: Part) -> None:
        """Start ``part`` (one of this launcher's, whose process has exited) again, with the
        same command line, in the same process group; its previous log is rotated. Does
        not wait for it to be ready.

        Raises:
            OSError: the command cannot be started.
        """
        assert part in self.parts and not part.alive(), f"{part.name}: not a dead part of ours"
        if part.proc is not None:
            part.proc.wait()  # reap it
        log = self.log_dir / f"{part.name}.log" if self.log_dir is not None else None
        try:
            start_part(part, log_path=log, env=self.env, process_group=self._pgid or 0)
        except PermissionError:
            # Every member of the group has exited, so it is gone: lead a new one (the
            # failed start left an empty log, which must not push the last one away).
            if log is not None:
                log.unlink(missing_ok=True)
            proc = start_part(part, log_path=log, env=self.env, process_group=0)
            self._pgid = proc.pid

    def part(self, name: str) -> Part:
        """The part called ``name`` (StopIteration when there is none)."""
        return next(p for p in self.parts if p.name == name)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every part, newest tier first, then SIGKILL the group.

        Tiers stop in reverse start order (router, engines, KV store, redis), each after
        the previous one exited (or ``timeout_s`` passed): a part never loses what it
        depends on (e.g. Redis) while it shuts down.
        """
        procs = [p.proc for p in self.parts if p.proc is not None]
        for tier in reversed(self._tiers):
            _terminate(tier, timeout_s)
        if self._pgid is not None:
            # Anything left in the group (stragglers, grandchildren) is killed.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._pgid, signal.SIGKILL)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.parts.clear()
        self._tiers.clear()
        self._pgid = None
