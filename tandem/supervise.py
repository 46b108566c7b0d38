"""Keeping a running stack's parts alive: a part that exits is started again, with backoff.

``tandem up`` is the one-box deployment, so it does what Kubernetes does for pods: a child
that exits (a crash, the OOM killer, ``kill -9``) is restarted with the same command line,
ports and instance id after an exponential backoff, and the rest of the stack keeps
serving meanwhile (the router fails over to the instances left; engines re-register in
Redis by their next heartbeat once it is back). Only Ctrl-C / SIGTERM stops the stack.

:class:`Supervisor` is polled by its owner (one call per supervision interval) and
returns what happened as lines for the terminal; it never sleeps itself.

Backoff: 1 s after the first exit, doubling with each exit that follows before the part
was ready for ``STABLE_S`` seconds, at most ``MAX_BACKOFF_S`` (Kubernetes' CrashLoopBackOff
shape, shorter: these are local processes). A restarted part not ready within the start-up
timeout is killed and counts as another exit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.launch import Launcher, Part

#: First restart delay, and the cap of its doubling (seconds).
BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
#: A part ready for this long has its backoff reset (seconds).
STABLE_S = 60.0


@dataclass
class _State:
    """Where one part is in its restart cycle (``time.monotonic()`` seconds)."""

    failures: int = 0
    down_since: float | None = None  # exited, not ready again yet
    restart_at: float | None = None  # scheduled restart
    started_at: float | None = None  # restarted, waiting for readiness
    ready_since: float | None = None
    restarts: int = 0


class Supervisor:
    """Restarts the parts of ``launcher`` that exit.

    Args:
        launcher: owns the parts and their process group (``Launcher.restart``).
        startup_timeout_s: how long a restarted part gets to become ready.
        clock: ``time.monotonic`` (tests pass their own).
        wall: formats a time stamp for messages (``HH:MM:SS`` local time by default).
    """

    def __init__(self, launcher: Launcher, startup_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> None:
        self.launcher = launcher
        self.startup_timeout_s = startup_timeout_s
        self._clock = clock
        self._wall = wall
        now = clock()
        self._states = {p.name: _State(ready_since=now) for p in launcher.parts}

    def restarts(self, name: str) -> int:
        """How often part ``name`` was started again."""
        return self._states[name].restarts

    def down(self) -> list[str]:
        """Names of the parts that are not running and ready now."""
        return [n for n, st in self._states.items() if st.down_since is not None]

    def poll(self) -> list[str]:
        """Look at every part once: schedule restarts of those that exited, start those
        whose backoff passed, report those that became ready.

        Returns:
            Lines for the terminal, one per event (what died and when, when it comes
            back, how long it was down).
        """
        now = self._clock()
        events: list[str] = []
        for part in list(self.launcher.parts):
            st = self._states.setdefault(part.name, _State(ready_since=now))
            if st.restart_at is not None:
                if now >= st.restart_at:
                    events += self._restart(part, st, now)
                continue
            if not part.alive():
                events.append(self._exited(part, st, now))
                continue
            if st.started_at is not None:
                if part.ready():
                    st.started_at, st.ready_since = None, now
                    down = now - (st.down_since or now)
                    st.down_since = None
                    events.append(f"tandem up: {part.name} is back at {self._wall()} "
                                  f"(down {down:.1f} s, restart {st.restarts})")
                elif now - st.started_at > self.startup_timeout_s:
                    assert part.proc is not None
                    part.proc.kill()
                    part.proc.wait()
                    events.append(self._exited(part, st, now, why="not ready in time"))
            elif st.ready_since is not None and st.failures and now - st.ready_since >= STABLE_S:
                st.failures = 0
        return events

    def _exited(self, part: Part, st: _State, now: float, why: str | None = None) -> str:
        assert part.proc is not None
        code = part.proc.poll()
        st.failures += 1
        st.ready_since = st.started_at = None
        if st.down_since is None:
            st.down_since = now
        delay = min(MAX_BACKOFF_S, BASE_BACKOFF_S * 2 ** (st.failures - 1))
        st.restart_at = now + delay
        reason = why or f"exited with code {code}"
        tail = part.log_tail(10)
        return (f"tandem up: {part.name} {reason} at {self._wall()}; restarting in "
                f"{delay:g} s" + (f"; its log ends:\n{tail}" if tail else ""))

    def _restart(self, part: Part, st: _State, now: float) -> list[str]:
        st.restart_at = None
        try:
            self.launcher.restart(part)
        except OSError as exc:
            return [self._exited(part, st, now, why=f"could not be started ({exc})")]
        st.restarts += 1
        st.started_at = now
        return []
