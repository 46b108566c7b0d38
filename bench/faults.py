"""Fault schedules for `tandem bench serve --fault PART@SECONDS`: kill parts of a launched
stack while the load runs, restart them as `tandem up` does, and say when each came back.

A fault is ``SIGKILL`` of one of the stack's parts (``decode-0``, ``prefill-1``,
``kvstore``, ``redis``: the names `tandem up` prints) at a time counted from the start of
the measured run. A :class:`tandem.supervise.Supervisor` polls the stack meanwhile, so a
killed part is restarted with `tandem up`'s back-off and the run measures what users of
`tandem up` see: requests migrated or retried, and those that failed.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass

from tandem.launch import Launcher
from tandem.supervise import Supervisor

#: seconds between two looks of the supervisor at the stack
POLL_S = 0.2


@dataclass(frozen=True)
class Fault:
    """Kill part ``part`` ``at_s`` seconds into the run."""

    part: str
    at_s: float

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``"decode-0@30"`` or ``"decode-0@30s"``.

        Raises:
            ValueError: naming ``--fault`` when the text has another shape.
        """
        name, sep, when = text.partition("@")
        try:
            at_s = float(when.removesuffix("s")) if sep else -1.0
        except ValueError:
            at_s = -1.0
        if not name or at_s < 0:
            raise ValueError(f"--fault must look like PART@SECONDS (decode-0@30), got {text!r}")
        return cls(name, at_s)


class FaultInjector:
    """Runs a fault schedule on a thread while the load runs (a context manager).

    A part it restarts is a child of that thread, so it gets SIGTERM when the thread ends
    (tandem.child's ``PR_SET_PDEATHSIG`` follows the creating thread): the stack serves the
    faulted run and is closed after it, never reused.

    Args:
        launcher: the launched stack's parts (``Stack.launcher``).
        faults: what to kill and when.
        startup_timeout_s: how long a restarted part gets to become ready.

    Raises:
        ValueError: on entry, naming ``--fault`` when a part is not in the stack.
    """

    def __init__(self, launcher: Launcher, faults: list[Fault],
                 startup_timeout_s: float = 600.0) -> None:
        self.launcher = launcher
        self.faults = sorted(faults, key=lambda f: f.at_s)
        self.startup_timeout_s = startup_timeout_s
        #: (seconds into the run, what happened), for the report
        self.events: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Every fault names a part of the stack.

        Raises:
            ValueError: naming ``--fault`` and the stack's parts.
        """
        names = {p.name for p in self.launcher.parts}
        for f in self.faults:
            if f.part not in names:
                raise ValueError(f"--fault: no part {f.part!r} in the stack "
                                 f"(parts: {', '.join(sorted(names))})")

    def __enter__(self) -> FaultInjector:
        self.check()
        self._thread = threading.Thread(target=self._run, name="fault-injector", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop killing; wait until every killed part is back (its restart is part of
        what the run reports), at most ``startup_timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        supervisor = Supervisor(self.launcher, self.startup_timeout_s)
        start = time.monotonic()
        pending = list(self.faults)
        stop_at: float | None = None
        while True:
            stopped = self._stop.wait(POLL_S)
            now = time.monotonic() - start
            if stopped:
                # the run is over: no more kills, only the restarts still under way
                pending.clear()
                stop_at = now if stop_at is None else stop_at
            while pending and pending[0].at_s <= now:
                part = self.launcher.part(pending.pop(0).part)
                if part.proc is not None and part.alive():
                    part.proc.send_signal(signal.SIGKILL)
                    part.proc.wait()  # dead before the supervisor looks
                    self.events.append((now, f"killed {part.name}"))
            for line in supervisor.poll():
                self.events.append((time.monotonic() - start, line.split(";")[0]))
            if stop_at is not None and (not supervisor.down()
                                        or now - stop_at > self.startup_timeout_s):
                return
