"""Engines that share a host's CPU cores take turns for each model step.

Why: each engine runs its step on an OpenMP team as wide as the cores. Two engines
on the same cores (``tandem up``'s prefill and decode instances on one host) put two
teams on them at once, and a team only leaves a barrier when all its threads arrive:
a thread the OS has parked for the other team's threads stalls its whole team for a
scheduling quantum, at every one of a step's hundreds of barriers. Taking turns runs
each step on every core with no stall, the way one colocated engine runs its steps.

The turn is an advisory file lock (``flock(2)``) on a file the engines share, held for
the model step only (scheduling, I/O and the service's threads run outside it). The
kernel drops a dead process's lock, so an engine that is killed mid-step never blocks
the others. A second lock, ``PATH.queue``, makes the turns fair: a waiter holds it
while it waits for the turn, so the engine that just gave the turn up cannot take it
again before that waiter has had one (strict alternation between two engines; with
more, every waiter is served before the last holder again, in no fixed order). The
turns are fair in steps, not in time: while one engine runs long prefill steps, the
other gets one step per prefill step. A stopped (SIGSTOP) engine keeps the lock it
holds, waiting or stepping, and holds up the others until it continues.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


class CpuTurns:
    """One engine's handle on the host's shared step turn.

    Args:
        path: the lock file every engine sharing the cores names (created if missing,
            with ``PATH.queue`` beside it; both stay empty).

    Raises:
        OSError: the file cannot be created or opened (a missing folder, no permission).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._turn = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._queue = os.open(path + ".queue", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            os.close(self._turn)
            raise
        #: turns taken so far
        self.num_turns = 0
        #: seconds spent waiting for turns so far (monotonic clock)
        self.wait_seconds = 0.0

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for the body (blocks while another engine holds it).

        Raises:
            OSError: the handle was closed.
        """
        start = time.monotonic()
        fcntl.flock(self._queue, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._turn, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._queue, fcntl.LOCK_UN)
        self.wait_seconds += time.monotonic() - start
        self.num_turns += 1
        try:
            yield
        finally:
            fcntl.flock(self._turn, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close the files (a turn held now is given up); idempotent."""
        for fd in (self._turn, self._queue):
            try:
                os.close(fd)
            except OSError:
                pass
        self._turn = self._queue = -1
