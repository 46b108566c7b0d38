"""Engines that share a host's CPU cores take turns for their model steps, fair in time.

Why: each engine runs its step on an OpenMP team as wide as the cores. Two engines
on the same cores (``tandem up``'s prefill and decode instances on one host) put two
teams on them at once, and a team only leaves a barrier when all its threads arrive:
a thread the OS has parked for the other team's threads stalls its whole team for a
scheduling quantum, at every one of a step's hundreds of barriers. Taking turns runs
each step on every core with no stall, the way one colocated engine runs its steps.

The turn is an advisory file lock (``flock(2)``) on a file the engines share, held for
model steps only (scheduling, I/O and the service's threads run outside it, or in the
short gaps between the steps of one turn). The kernel drops a dead process's lock, so
an engine that is killed mid-step never blocks the others. A second lock,
``PATH.queue``, orders the turns: a waiter holds it while it waits for the turn, so the
engine that just gave the turn up cannot take it again before that waiter has had one
(strict alternation between two engines; with more, every waiter is served before the
last holder again, in no fixed order).

Fair in time, not in steps: a turn may last as long as another engine's turn before it
(its length and its holder are written into the lock file when it ends), so an engine
whose steps are short (a decode batch) runs as many of them in its turn as fit in the
time the other engine's last turn took (a long prefill step), and the two share the
cores about equally while both have work; with steps of equal length they alternate
step by step. An engine that takes the turn after its own turn (the other one idle)
gets one step at a time, so a long turn of the past never delays an engine that comes
back. An engine keeps
its turn between two steps of one turn only while the next step starts within
``idle_release_s``: a background thread gives the turn up when the engine goes idle (no
request left, or waiting for remote KV). A stopped (SIGSTOP) engine keeps the lock it
holds, waiting or stepping, and holds up the others until it continues.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Seconds an engine keeps its turn after a step for its next step to start; then the
#: turn is given up (an idle engine must not hold up the others).
IDLE_RELEASE_S = 0.005
#: The longest turn an engine takes after another's (seconds): bounds what a damaged
#: lock file (or a stalled holder) can make the others wait.
MAX_TURN_S = 10.0
#: at offset 0 of the lock file: the last turn's length (seconds) and its holder's token
_LAST_TURN = struct.Struct("<d16s")

logger = logging.getLogger(__name__)


class CpuTurns:
    """One engine's handle on the host's shared step turn.

    Args:
        path: the lock file every engine sharing the cores names (created if missing,
            with ``PATH.queue`` beside it). It holds the length of the last turn taken
            (float64 seconds) and a token of the handle that took it, written by the
            holder as it gives the turn up (a write that fails is logged and skipped).
        idle_release_s: how long a turn is kept after a step for the next step (seconds).
        clock: monotonic seconds that turn and step lengths are measured in (tests pass
            a fake one; the wait for a turn and the idle release use the real clock).

    Raises:
        OSError: the file cannot be created or opened (a missing folder, no permission).
        ValueError: ``idle_release_s`` below 0.
    """

    def __init__(self, path: str, *, idle_release_s: float = IDLE_RELEASE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not idle_release_s >= 0:
            raise ValueError(f"idle_release_s must be >= 0, got {idle_release_s}")
        self.path = path
        self.idle_release_s = idle_release_s
        self._token = os.urandom(16)  # this handle's mark on the turns it writes
        self._write_failed = False
        self._clock = clock
        self._turn = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            self._queue = os.open(path + ".queue", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            os.close(self._turn)
            raise
        #: turns taken so far
        self.num_turns = 0
        #: steps run so far (a turn holds one step or more)
        self.num_steps = 0
        #: seconds spent waiting for turns so far (monotonic clock)
        self.wait_seconds = 0.0
        self._cond = threading.Condition()
        self._held = False
        self._in_step = False
        self._since = 0.0  # when the held turn began (``clock``)
        self._budget = 0.0  # how long the held turn may last (``clock`` seconds)
        self._release_at: float | None = None  # time.monotonic() of the idle release
        self._closed = False
        self._releaser: threading.Thread | None = None

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold the turn for the body, one model step (blocks while another engine holds
        it); the turn may go on through the next step (the module docstring).

        Raises:
            OSError: the handle was closed.
        """
        with self._cond:
            if self._closed:
                raise OSError(f"CpuTurns({self.path!r}) is closed")
            kept = self._held
            if kept:
                self._in_step, self._release_at = True, None
        if not kept:
            self._take()
        step_start = self._clock()
        try:
            yield
        finally:
            now = self._clock()
            with self._cond:
                self.num_steps += 1
                self._in_step = False
                if self._closed:
                    self._held = False
                # keep the turn only if one more step as long as this one still fits
                elif now - self._since + (now - step_start) <= self._budget:
                    self._release_at = time.monotonic() + self.idle_release_s
                    self._start_releaser()
                    self._cond.notify_all()
                else:
                    self._give_up(now)

    def _take(self) -> None:
        start = time.monotonic()
        try:
            fcntl.flock(self._queue, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._turn, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._queue, fcntl.LOCK_UN)
            raw = os.pread(self._turn, _LAST_TURN.size, 0)
        except ValueError as exc:  # the handle was closed by another thread meanwhile
            raise OSError(f"CpuTurns({self.path!r}) is closed") from exc
        last, token = _LAST_TURN.unpack(raw) if len(raw) == _LAST_TURN.size else (0.0, b"")
        if token == self._token:
            last = 0.0  # after our own turn: one step at a time
        with self._cond:
            self.wait_seconds += time.monotonic() - start
            self.num_turns += 1
            self._held, self._in_step = True, True
            self._since = self._clock()
            self._budget = min(last, MAX_TURN_S) if math.isfinite(last) and last > 0 else 0.0

    def _give_up(self, now: float) -> None:
        """End the held turn (``self._cond`` held): write its length, unlock."""
        self._held, self._release_at = False, None
        try:
            os.pwrite(self._turn, _LAST_TURN.pack(max(0.0, now - self._since), self._token), 0)
        except OSError as exc:
            # The turns stay safe without it (the next holder reads an older length):
            # a full disk must not fail a step that has run.
            if not self._write_failed:
                logger.warning("cannot write the turn's length to %s: %s", self.path, exc)
            self._write_failed = True
        fcntl.flock(self._turn, fcntl.LOCK_UN)

    def _start_releaser(self) -> None:
        if self._releaser is None:
            self._releaser = threading.Thread(target=self._release_when_idle, daemon=True,
                                              name="cpu-turns-release")
            self._releaser.start()

    def _release_when_idle(self) -> None:
        with self._cond:
            while not self._closed:
                due = self._release_at
                if not self._held or self._in_step or due is None:
                    self._cond.wait()
                    continue
                delay = due - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                self._give_up(self._clock())

    def close(self) -> None:
        """Close the files (a turn held now is given up); idempotent."""
        with self._cond:
            self._closed = True
            self._held = False
            self._cond.notify_all()
            for fd in (self._turn, self._queue):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._turn = self._queue = -1
        if self._releaser is not None and self._releaser is not threading.current_thread():
            self._releaser.join(timeout=5)
