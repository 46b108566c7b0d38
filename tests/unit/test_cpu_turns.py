"""Engines that share CPU cores take turns for their model steps (engine/cpu_turns.py):
fair between processes, in time (a short-step engine runs several steps in the time of
the other's long step), released by a killed holder and by an engine gone idle, taken
by the engine for every model step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_core import BLOCK, MAX_LEN, make_request, tiny  # noqa: F401 - fixture
from waiting import wait_until

from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tandem.engine.cpu_turns import CpuTurns
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor

#: A process that takes one turn: it writes MARKER inside it, then exits.
_ONE_TURN = """
import sys
import os
from pathlib import Path
from tandem.engine.cpu_turns import CpuTurns
turns = CpuTurns(sys.argv[1])
with turns.turn():
    Path(sys.argv[2]).write_text("took its turn")
    if len(sys.argv) > 3:
        sys.stdin.read()  # hold the turn until killed
"""


def _start(lock: Path, marker: Path, hold: bool = False) -> subprocess.Popen[str]:
    argv = [sys.executable, "-P", "-c", _ONE_TURN, str(lock), str(marker)]
    return subprocess.Popen([*argv, "hold"] if hold else argv, stdin=subprocess.PIPE, text=True)


def _blocked_on_a_lock(pid: int) -> bool:
    """``pid`` waits for a file lock (the kernel lists it with ``->`` in /proc/locks)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 4] == str(pid):
            return True
    return False


def test_a_waiting_engine_goes_before_the_one_that_just_ended_its_turn(tmp_path) -> None:
    """Bug this guards against: flock alone is not fair, so an engine that ends its step
    and starts the next at once can take the turn again and again while another waits."""
    lock, marker = tmp_path / "turns.lock", tmp_path / "marker"
    turns = CpuTurns(str(lock))
    try:
        with turns.turn():
            other = _start(lock, marker)
            wait_until(lambda: _blocked_on_a_lock(other.pid) or other.poll() is not None, 60,
                       "the other process waiting for the turn")
            assert other.poll() is None, "the other process ended without waiting"
        with turns.turn():
            assert marker.read_text() == "took its turn"
        assert other.wait(timeout=60) == 0
    finally:
        turns.close()
    assert turns.num_turns == 2


def test_a_killed_holder_gives_the_turn_up(tmp_path) -> None:
    """An engine killed mid-step must not block the others: the kernel drops its lock."""
    lock, marker = tmp_path / "turns.lock", tmp_path / "marker"
    holder = _start(lock, marker, hold=True)
    try:
        wait_until(lambda: marker.exists() or holder.poll() is not None, 60,
                   "the holder taking its turn")
        assert holder.poll() is None
        holder.kill()
        holder.wait(timeout=60)
        turns = CpuTurns(str(lock))
        with turns.turn():
            pass
        turns.close()
        turns.close()  # idempotent
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_the_engine_steps_only_in_its_turn(tiny, tmp_path) -> None:  # noqa: F811
    loaded, _ = tiny
    lock = str(tmp_path / "turns.lock")
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=32),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        parallel=ParallelConfig(shared_cpu_lock=lock),
    )
    core = EngineCore(config, create_executor(config, loaded))
    try:
        assert core.cpu_turns is not None
        for prompt in ([1, 2, 3], [4, 5, 6, 7]):
            core.add_request(make_request(prompt, max_tokens=5))
        while core.has_unfinished_requests():
            core.step()
        assert core.num_steps > 0
        assert core.cpu_turns.num_steps == core.num_steps
        assert 1 <= core.cpu_turns.num_turns <= core.num_steps
    finally:
        core.shutdown()


@pytest.mark.parametrize("kwargs, field", [
    ({"shared_cpu_lock": ""}, "shared_cpu_lock"),
    ({"shared_cpu_lock": "/tmp/x.lock", "pipeline_parallel_size": 2,
      "distributed_executor_backend": "mp"}, "shared_cpu_lock"),
])
def test_bad_shared_cpu_lock_is_a_value_error_naming_it(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_a_lock_file_that_cannot_be_created_fails_at_once_naming_the_flag(tmp_path) -> None:
    """Bug: a --shared-cpu-lock in a missing folder failed only after the model had loaded
    and the KV cache was allocated, with a traceback that did not name the flag."""
    from tandem.services.common.server import build_engine_config, build_parser

    parser = build_parser("tandem serve", None)
    bad = str(tmp_path / "missing" / "x.lock")
    ns = parser.parse_args(["--role", "both", "--shared-cpu-lock", bad])
    with pytest.raises(ValueError, match=f"--shared-cpu-lock {bad}: cannot open or create"):
        build_engine_config(ns, "both")
    good = str(tmp_path / "x.lock")
    ns = parser.parse_args(["--role", "both", "--shared-cpu-lock", good])
    assert build_engine_config(ns, "both").parallel.shared_cpu_lock == good


def test_the_wait_for_a_turn_is_counted_and_exported(tmp_path) -> None:
    """``wait_seconds`` holds at least the time a waiter was seen blocked before the
    holder let go, and the service's ``tandem:cpu_turn_wait_seconds`` follows it."""
    import threading
    import time

    from test_spec_decode import _idle_stats

    from tandem.contracts.role import Role
    from tandem.engine.spec_decode.policy import SpecDecodeStats
    from tandem.services.common.metrics import ServiceMetrics

    lock = str(tmp_path / "turns.lock")
    holder, waiter = CpuTurns(lock), CpuTurns(lock)  # two open files: their locks conflict
    try:
        with holder.turn():
            def take_a_turn() -> None:
                with waiter.turn():
                    pass

            thread = threading.Thread(target=take_a_turn)
            thread.start()
            wait_until(lambda: _blocked_on_a_lock(os.getpid()), 60, "the waiter blocked")
            seen = time.monotonic()
        released = time.monotonic()
        thread.join(timeout=60)
        assert waiter.num_turns == 1
        assert waiter.wait_seconds >= released - seen
    finally:
        holder.close()
        waiter.close()
    metrics = ServiceMetrics(Role.DECODE)
    stats = _idle_stats(SpecDecodeStats(0))
    for total in (1.5, 1.5, 2.25):
        metrics.observe_stats(stats, 0, cpu_turn_wait_s=total)
    value = metrics.registry.get_sample_value
    assert value("tandem:cpu_turn_wait_seconds_total", {"role": "decode"}) == 2.25


class _Clock:
    """A monotonic clock that moves only when told (turn and step lengths)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _turn_in_thread(turns: CpuTurns):
    import threading

    def take() -> None:
        with turns.turn():
            pass

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread


def test_a_short_step_engine_runs_steps_for_as_long_as_the_long_step_took(tmp_path) -> None:
    """Bug this guards against: turns alternated steps, so beside a prefill engine whose
    steps took 1 s a decode engine ran one 20 ms step per second (its streams slowed to
    a token a second). Now a turn lasts as long as the one before it: after a 1 s step
    of A, B runs its 0.125 s steps until one more would pass 1 s, while A waits."""
    lock, clock = str(tmp_path / "turns.lock"), _Clock()
    a = CpuTurns(lock, clock=clock, idle_release_s=3600)
    b = CpuTurns(lock, clock=clock, idle_release_s=3600)
    try:
        with a.turn():
            clock.now += 1.0  # A's long step
        waiter = None
        for step in range(1, 9):
            with b.turn():
                clock.now += 0.125
            assert b.num_turns == 1 and b.num_steps == step
            if waiter is None:
                waiter = _turn_in_thread(a)
                wait_until(lambda: _blocked_on_a_lock(os.getpid()), 60, "A waiting")
            if step < 8:
                assert a.num_turns == 1, f"A took the turn after B's step {step}"
        waiter.join(timeout=60)
        assert not waiter.is_alive() and a.num_turns == 2
        # B's turn was 1 s long: A may now run steps for 1 s, one of 1 s ends its turn
        with a.turn():
            clock.now += 1.0
        with b.turn():
            clock.now += 0.125
        assert b.num_turns == 2
    finally:
        a.close()
        b.close()


def test_steps_of_equal_length_alternate(tmp_path) -> None:
    lock, clock = str(tmp_path / "turns.lock"), _Clock()
    a = CpuTurns(lock, clock=clock, idle_release_s=3600)
    b = CpuTurns(lock, clock=clock, idle_release_s=3600)
    try:
        for n in range(1, 4):
            for turns in (a, b):
                with turns.turn():
                    clock.now += 0.25
                assert turns.num_turns == n  # never kept: a second step would not fit
    finally:
        a.close()
        b.close()


def test_an_engine_gone_idle_gives_its_turn_up(tmp_path) -> None:
    """A turn kept for a next step that does not come (no request left, waiting for
    remote KV) is given up by the handle's own thread, so the others are not held up."""
    lock, clock = str(tmp_path / "turns.lock"), _Clock()
    first = CpuTurns(lock, clock=clock)
    idle = CpuTurns(lock, clock=clock, idle_release_s=0.01)
    other = CpuTurns(lock, clock=clock)
    try:
        with first.turn():
            clock.now += 1.0
        with idle.turn():
            clock.now += 0.125  # kept: 7 more such steps would fit
        thread = _turn_in_thread(other)
        thread.join(timeout=60)
        assert not thread.is_alive(), "the idle engine kept the turn"
        assert (idle.num_turns, other.num_turns) == (1, 1)
    finally:
        for turns in (first, idle, other):
            turns.close()
    with pytest.raises(OSError, match="closed"):
        with idle.turn():
            pass
    with pytest.raises(ValueError, match="idle_release_s"):
        CpuTurns(lock, idle_release_s=-1)


def test_after_its_own_turn_an_engine_gets_one_step_at_a_time(tmp_path) -> None:
    """Bug this guards against: a turn took the length of the last turn written, its
    own included, so after one long step of the prefill engine the decode engine gave
    itself turns that long again and again while the prefill engine was idle, and the
    prefill engine's next step waited up to that long when it came back."""
    lock, clock = str(tmp_path / "turns.lock"), _Clock()
    a = CpuTurns(lock, clock=clock, idle_release_s=3600)
    b = CpuTurns(lock, clock=clock, idle_release_s=3600)
    try:
        with b.turn():
            clock.now += 1.0  # B's long step; then B goes idle
        with a.turn():
            clock.now += 0.125  # after B's turn: kept (seven more such steps fit)
        assert a.num_turns == 1
        for _ in range(7):
            with a.turn():
                clock.now += 0.125
        assert a.num_turns == 1 and a.num_steps == 8  # its 1 s turn ended
        for n in range(2, 5):
            with a.turn():
                clock.now += 0.125
            assert a.num_turns == n, "a turn after its own was kept"
    finally:
        a.close()
        b.close()


#: Steps under RLIMIT_FSIZE=0 (writes past the empty lock file fail with EFBIG).
_FULL_DISK = """
import resource, signal, sys
from tandem.engine.cpu_turns import CpuTurns
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
turns = CpuTurns(sys.argv[1])
for _ in range(3):
    with turns.turn():
        pass
turns.close()
print("steps", turns.num_steps)
"""


def test_a_lock_file_that_cannot_be_written_does_not_fail_the_steps(tmp_path) -> None:
    """Bug this guards against: the length written as a turn ends (a full disk here)
    raised out of the step that had run, and the engine failed every request."""
    out = subprocess.run([sys.executable, "-P", "-c", _FULL_DISK, str(tmp_path / "t.lock")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "steps 3" in out.stdout
    assert out.stderr.count("cannot write the turn's length") == 1, out.stderr


def test_closing_a_handle_whose_thread_waits_for_the_turn_is_an_oserror(tmp_path) -> None:
    import threading

    lock = str(tmp_path / "turns.lock")
    holder, waiter = CpuTurns(lock), CpuTurns(lock)
    raised: list[BaseException] = []

    def take() -> None:
        try:
            with waiter.turn():
                pass
        except BaseException as exc:  # noqa: BLE001 - what it raised is the test
            raised.append(exc)

    try:
        with holder.turn():
            thread = threading.Thread(target=take, daemon=True)
            thread.start()
            wait_until(lambda: _blocked_on_a_lock(os.getpid()), 60, "the waiter blocked")
            waiter.close()
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert len(raised) == 1 and isinstance(raised[0], OSError), raised
    finally:
        holder.close()
