"""`tandem bench serve --fault`: the schedule's parsing, and the injector on real child
processes (a part killed at its time and restarted by `tandem up`'s supervisor)."""

from __future__ import annotations

import pytest
from test_supervise import _part
from waiting import wait_until

from tandem.bench.faults import Fault, FaultInjector
from tandem.launch import Launcher


@pytest.mark.parametrize(("text", "want"), [("decode-0@30", Fault("decode-0", 30.0)),
                                            ("redis@2.5s", Fault("redis", 2.5)),
                                            ("kvstore@0", Fault("kvstore", 0.0))])
def test_fault_parse(text: str, want: Fault) -> None:
    assert Fault.parse(text) == want


@pytest.mark.parametrize("text", ["decode-0", "@3", "decode-0@", "decode-0@-1", "x@soon"])
def test_fault_parse_rejects_other_shapes(text: str) -> None:
    with pytest.raises(ValueError, match="--fault"):
        Fault.parse(text)


def test_injector_kills_on_schedule_and_the_part_comes_back(tmp_path) -> None:
    launcher = Launcher(tmp_path)
    try:
        launcher.launch([_part(tmp_path, "a"), _part(tmp_path, "b")], timeout_s=60)
        a, b = launcher.part("a"), launcher.part("b")
        pid_a, pid_b = a.proc.pid, b.proc.pid
        with FaultInjector(launcher, [Fault("a", 0.0)], startup_timeout_s=60) as inj:
            wait_until(lambda: any("a is back" in e for _, e in inj.events), 60,
                       "part a restarted and ready")
            # NOTE: checked before the injector's thread ends: a part it restarted is
            # tied to that thread (PR_SET_PDEATHSIG) and gets SIGTERM when it does.
            assert a.proc.pid != pid_a and a.alive()
            assert b.proc.pid == pid_b and b.alive(), "only the scheduled part is killed"
        events = [e for _, e in inj.events]
        assert events[0] == "killed a", events
    finally:
        launcher.close(timeout_s=10)


def test_injector_rejects_a_part_the_stack_lacks(tmp_path) -> None:
    launcher = Launcher(tmp_path)
    injector = FaultInjector(launcher, [Fault("decode-9", 1.0)])
    with pytest.raises(ValueError, match="--fault: no part 'decode-9'"):
        injector.check()  # what bench serve calls before its baseline run
    with pytest.raises(ValueError, match="--fault: no part 'decode-9'"):
        injector.__enter__()
