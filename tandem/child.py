"""Start a child process that dies with its parent and may be pinned to CPUs,
without ``fork()`` in the parent.

``spawn(argv, cpus=..., **popen_kwargs)`` starts ``child_argv(argv, cpus)``: a
command line wrapped so that it first runs this file
(standard library only, so it starts fast), which asks Linux to send it
SIGTERM when the parent dies (``PR_SET_PDEATHSIG``), pins its CPUs, then
``exec``s the real command in the same process.

Why not ``subprocess.Popen(preexec_fn=...)``: a ``preexec_fn`` makes Python
``fork()`` instead of ``vfork()``, and ``fork()`` runs the ``pthread_atfork``
handlers of every library loaded in the parent. After gRPC has been used in the
parent (``tandem up`` polls its engines' gRPC health), gRPC's handlers abort
the child now and then (``ev_epoll1_linux.cc ... Check failed:
wakeup_fd_->Wakeup().ok()`` or ``epoll_wait error: Bad file descriptor``; seen
in 15 of 300 forks here), so a stack failed to start at random. Without
``preexec_fn`` subprocess uses ``vfork()``, which runs no fork handlers.

Usage (what ``child_argv`` builds)::

    python -I -S tandem/child.py --parent PID [--cpus 0,1] -- CMD [ARG ...]

Exit status 127 when ``CMD`` cannot be executed; the parent having died already
exits 143 (as if the SIGTERM had come).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def child_argv(argv: Sequence[str], cpus: Sequence[int] | None = None) -> list[str]:
    """``argv`` wrapped to run as a child of this process that dies with it.

    Args:
        argv: the command line to run (``argv[0]`` is looked up on ``PATH``).
        cpus: CPU ids to pin the child to, or ``None``/empty for no pinning.

    Returns:
        The command line to give ``subprocess.Popen`` (without ``preexec_fn``).
        The SIGTERM on death follows the *thread* that starts the child, so
        start it from a thread that lives as long as the child should.

    Raises:
        ValueError: on an empty ``argv`` or a negative CPU id.
    """
    if not argv:
        raise ValueError("argv: empty command line")
    if cpus and min(cpus) < 0:
        raise ValueError(f"cpus: CPU ids must be >= 0, got {list(cpus)}")
    out = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--parent", str(os.getpid())]
    if cpus:
        out += ["--cpus", ",".join(str(c) for c in cpus)]
    return [*out, "--", *argv]


def spawn(argv: Sequence[str], cpus: Sequence[int] | None = None,
          **popen_kwargs: object) -> subprocess.Popen:
    """``subprocess.Popen(child_argv(argv, cpus), **popen_kwargs)``: a child that gets
    SIGTERM when this process (the calling thread) dies, started by ``vfork``.

    Raises:
        ValueError: as ``child_argv``, or when ``popen_kwargs`` holds ``preexec_fn``
            (it would bring back the ``fork()`` this module exists to avoid).
        OSError: when the Python interpreter cannot be started.
    """
    if popen_kwargs.get("preexec_fn") is not None:
        raise ValueError("preexec_fn: not allowed (it makes subprocess fork(); see tandem.child)")
    return subprocess.Popen(child_argv(argv, cpus), **popen_kwargs)  # type: ignore[call-overload]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem.child", description=__doc__)
    p.add_argument("--parent", type=int, required=True, help="pid that must be alive")
    p.add_argument("--cpus", default="", help="comma-separated CPU ids to pin to")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("a command is required after --")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        pass
    # The parent may have died before prctl: the kernel then never signals us.
    if os.getppid() != args.parent:
        return 128 + signal.SIGTERM
    if args.cpus:
        os.sched_setaffinity(0, [int(c) for c in args.cpus.split(",")])
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"tandem.child: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - execvp does not return


if __name__ == "__main__":
    sys.exit(main())
