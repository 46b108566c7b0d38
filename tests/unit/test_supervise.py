"""``tandem up``'s supervision (tandem/supervise.py) on real child processes: a part that
exits is started again after its backoff, the others are left alone, its log is rotated,
and a part that is not ready in time is killed and counts as another exit. The clock is the
test's own, so backoffs pass without waiting; readiness is the child's own report."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tandem.launch import Launcher, Part, wait_ready
from tandem.supervise import MAX_BACKOFF_S, STABLE_S, Supervisor

# Writes its pid to argv[1] when "ready" (unless argv[2] says never), then idles.
_CHILD = (
    "import os, signal, sys\n"
    "print('started', os.getpid(), flush=True)\n"
    "if sys.argv[2] != 'never':\n"
    "    open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid()))\n"
    "    os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "signal.pause()\n"
)


def _part(tmp: Path, name: str, mode: str = "ok") -> Part:
    flag = tmp / f"{name}.ready"

    def ready() -> bool:
        part = parts[name]
        try:
            return part.proc is not None and flag.read_text() == str(part.proc.pid)
        except FileNotFoundError:
            return False

    part = Part(name, [sys.executable, "-c", _CHILD, str(flag), mode], ready)
    parts[name] = part
    return part


parts: dict[str, Part] = {}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stack(tmp_path):
    launcher = Launcher(tmp_path)
    launcher.launch([_part(tmp_path, "a"), _part(tmp_path, "b")], timeout_s=60)
    clock = Clock()
    yield launcher, Supervisor(launcher, startup_timeout_s=30, clock=clock, wall=lambda: "T"), clock
    launcher.close(timeout_s=5)


def _kill(part: Part) -> None:
    assert part.proc is not None
    os.kill(part.proc.pid, signal.SIGKILL)
    part.proc.wait()


def test_an_exited_part_is_restarted_after_its_backoff_and_the_rest_left_alone(stack,
                                                                                tmp_path) -> None:
    launcher, sup, clock = stack
    a, b = launcher.part("a"), launcher.part("b")
    b_pid, a_pid = b.proc.pid, a.proc.pid  # type: ignore[union-attr]
    assert sup.poll() == []
    _kill(a)
    (event,) = sup.poll()
    assert event.startswith("tandem up: a exited with code -9 at T; restarting in 1 s")
    assert "started" in event  # the end of its log is shown
    assert sup.down() == ["a"]
    clock.now += 0.5
    assert sup.poll() == [] and not a.alive()  # still backing off
    clock.now += 0.6
    assert sup.poll() == [] and a.alive() and a.proc.pid != a_pid  # type: ignore[union-attr]
    wait_ready([a], 60)
    (back,) = sup.poll()
    assert back == "tandem up: a is back at T (down 1.1 s, restart 1)"
    assert sup.down() == [] and sup.restarts("a") == 1 and sup.restarts("b") == 0
    assert b.proc.pid == b_pid  # type: ignore[union-attr]
    # The first run's log was rotated, not overwritten.
    assert (tmp_path / "a.log.1").read_text().startswith(f"started {a_pid}")
    assert (tmp_path / "a.log").read_text().startswith(f"started {a.proc.pid}")  # type: ignore[union-attr]


def test_backoff_doubles_while_a_part_keeps_failing_and_resets_once_stable(stack) -> None:
    launcher, sup, clock = stack
    a = launcher.part("a")
    delays = []
    for _ in range(7):
        _kill(a)
        (event,) = sup.poll()
        delays.append(float(event.split("restarting in ")[1].split(" s")[0]))
        clock.now += delays[-1]
        sup.poll()  # restarts it
        wait_ready([a], 60)
        sup.poll()  # back
    assert delays == [1, 2, 4, 8, 16, MAX_BACKOFF_S, MAX_BACKOFF_S]
    clock.now += STABLE_S
    sup.poll()
    _kill(a)
    (event,) = sup.poll()
    assert "restarting in 1 s" in event


def test_a_restarted_part_not_ready_in_time_is_killed_and_tried_again(tmp_path) -> None:
    launcher = Launcher(tmp_path)
    launcher.launch([_part(tmp_path, "c")], timeout_s=60)
    clock = Clock()
    sup = Supervisor(launcher, startup_timeout_s=30, clock=clock, wall=lambda: "T")
    try:
        c = launcher.part("c")
        original = c.proc.pid  # type: ignore[union-attr]
        c.argv[-1] = "never"  # from now on it never becomes ready
        _kill(c)
        sup.poll()
        clock.now += 1
        sup.poll()
        assert c.alive()
        first = c.proc.pid  # type: ignore[union-attr]
        clock.now += 31
        (event,) = sup.poll()
        assert event.startswith("tandem up: c not ready in time at T; restarting in 2 s")
        assert not c.alive() and c.proc.pid == first  # type: ignore[union-attr]
        # Its group died with it (it was the only part): the restart leads a new one, and
        # the log of the run before is kept, not replaced by the failed start's.
        assert (tmp_path / "c.log.1").read_text().startswith(f"started {original}")
        assert not (tmp_path / "c.log.2").exists()
    finally:
        launcher.close(timeout_s=5)
