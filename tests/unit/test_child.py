"""tandem/child.py: children that die with their parent, started without fork()."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from waiting import wait_until

from tandem.child import child_argv, spawn

# A process that uses gRPC (as `tandem up` does for its engines' health), then
# starts children: each must exec cleanly.
_SPAWN_AFTER_GRPC = textwrap.dedent("""
    import subprocess, sys
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from tandem.child import spawn

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    failed = []
    for _ in range(int(sys.argv[1])):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        p = spawn(["true"], stderr=subprocess.PIPE)
        err = p.communicate()[1]
        if p.returncode != 0:
            failed.append((p.returncode, err[-300:]))
    server.stop(None)
    print("failed", len(failed), failed[:1])
""")


def test_children_started_after_grpc_use_never_abort() -> None:
    """Bug: `tandem up` started its parts with ``preexec_fn`` (fork), and after its
    gRPC health checks gRPC's fork handlers aborted ~5% of the children (SIGABRT,
    ``Check failed: wakeup_fd_->Wakeup().ok()``): the router died during start-up in
    a CI run (with ``subprocess.Popen(preexec_fn=...)`` in place of ``spawn`` here,
    15 of 300 children aborted)."""
    out = subprocess.run([sys.executable, "-P", "-c", _SPAWN_AFTER_GRPC, "300"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "failed 0 " in out.stdout, out.stdout


def test_child_is_pinned_and_dies_with_its_parent() -> None:
    parent_code = textwrap.dedent("""
        import subprocess, sys
        from tandem.child import spawn
        p = spawn(["sleep", "300"], cpus=[0])
        print(p.pid, flush=True)
        sys.stdin.read()  # lives until killed
    """)
    parent = subprocess.Popen([sys.executable, "-P", "-c", parent_code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        child = psutil.Process(pid)
        wait_until(lambda: child.name() == "sleep", 30, "the child to exec sleep")
        assert os.sched_getaffinity(pid) == {0}
        assert child.ppid() == parent.pid
        parent.kill()
        parent.wait()
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
                   30, "the child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_child_exits_when_its_parent_is_already_gone() -> None:
    """A parent that died before PR_SET_PDEATHSIG took hold: the child never execs."""
    argv = child_argv(["touch", "/nonexistent-dir/never"])
    argv[argv.index("--parent") + 1] = str(os.getpid() + 1)  # not the child's parent
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr


def test_child_bad_input() -> None:
    with pytest.raises(ValueError, match="argv"):
        child_argv([])
    with pytest.raises(ValueError, match="cpus"):
        child_argv(["true"], cpus=[-1])
    with pytest.raises(ValueError, match="preexec_fn"):
        spawn(["true"], preexec_fn=lambda: None)
    done = subprocess.run(child_argv(["/nonexistent/tandem-no-such-binary"]),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 127 and "cannot run" in done.stderr
