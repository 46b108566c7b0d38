"""tandem/launch.py: the one launcher of `tandem up`, the benchmarks and the test harnesses."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest
from waiting import wait_until

from tandem.launch import Launcher, Part, StackError, start_part, stop_parts, wait_ready

# A child that stays up until a signal ends it (the launcher's stop is what ends it).
_SLEEPER = [sys.executable, "-c", "import signal; print('up', flush=True); signal.pause()"]


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_part_that_exits_during_start_up_fails_at_once_with_its_log(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    try:
        with pytest.raises(StackError, match=r"(?s)boom exited with code 3.*no config"):
            launcher.launch([Part("boom", _py("print('no config'); raise SystemExit(3)"),
                                  lambda: False)], timeout_s=300)
    finally:
        launcher.close()
    assert (tmp_path / "boom.log").read_text().strip() == "no config"


def test_not_ready_in_time_names_the_part(tmp_path: Path) -> None:
    part = Part("slow", _SLEEPER, lambda: False)
    start_part(part, log_path=tmp_path / "slow.log")
    try:
        with pytest.raises(StackError, match="not healthy after 0 s: slow"):
            wait_ready([part], timeout_s=0.0)
    finally:
        stop_parts([part], timeout_s=10)
    assert part.proc is not None and part.proc.poll() is not None


def test_close_stops_every_tier_and_the_group(tmp_path: Path) -> None:
    """Tiers stop newest first; a grandchild left in the group is killed too."""
    grandchild = tmp_path / "grandchild.pid"
    spawner = _py("import signal, subprocess, sys\n"
                  f"p = subprocess.Popen({_SLEEPER!r})\n"
                  f"open({str(grandchild)!r}, 'w').write(str(p.pid))\n"
                  "signal.pause()")
    launcher = Launcher(tmp_path)
    launcher.launch([Part("first", _SLEEPER, lambda: True)], timeout_s=60)
    launcher.launch([Part("second", spawner, grandchild.exists)], timeout_s=300)
    wait_until(lambda: grandchild.read_text(), 60, "grandchild pid written")
    pids = [p.proc.pid for p in launcher.parts if p.proc is not None]
    pids.append(int(grandchild.read_text()))
    assert [p.name for p in launcher.parts] == ["first", "second"]
    assert not launcher.dead_parts()
    launcher.close(timeout_s=10)
    assert launcher.parts == []

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    for pid in pids:  # SIGKILL is delivered asynchronously
        wait_until(lambda p=pid: gone(p), 30, f"pid {pid} to exit")
