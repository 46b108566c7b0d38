"""The shared-memory broadcast queue (engine/executor/shm_broadcast.py) between real
processes: order, streaming of oversized messages, a ring held back by a slow reader,
timeouts, dead peers, and no segment or resource-tracker complaint left behind.

Two reader processes (multiprocessing spawn) are started once for the module and run
one job per test, since each spawned child imports torch through the engine package
(seconds on a loaded 2-core machine).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.executor import shm_broadcast
from tandem.engine.executor.shm_broadcast import Handle, MessageQueue

SPAWN = mp.get_context("spawn")
# Generous: only a broken queue makes a wait this long, and it then fails the test.
HANG_GUARD_S = 60.0


def _segment_exists(handle: Handle) -> bool:
    return Path("/dev/shm", handle.name).exists()


def _reader_server(conn: Connection) -> None:
    """A reader process: per job ``(handle, rank, num_messages, gated)`` attach as
    ``rank``, say so, wait for a go when gated, read ``num_messages`` and send them back;
    ``None`` ends it. Its liveness check is the test process."""
    parent = mp.parent_process()
    assert parent is not None
    while (job := conn.recv()) is not None:
        handle, rank, num_messages, gated = job
        with MessageQueue.attach(handle, rank, is_alive=parent.is_alive) as queue:
            conn.send("attached")
            if gated:
                conn.recv()
            got = [queue.dequeue(timeout=HANG_GUARD_S) for _ in range(num_messages)]
        conn.send(got)


@pytest.fixture(scope="module")
def readers() -> Iterator[list[Connection]]:
    """Two reader processes' job pipes (see ``_reader_server``)."""
    procs, conns = [], []
    for _ in range(2):
        ours, theirs = SPAWN.Pipe()
        proc = SPAWN.Process(target=_reader_server, args=(theirs,), daemon=True)
        proc.start()
        procs.append(proc)
        conns.append(ours)
    yield conns
    for conn in conns:
        conn.send(None)
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        assert proc.exitcode == 0, f"reader process exited with {proc.exitcode}"


def _start_job(
    conns: list[Connection], handle: Handle, num_messages: int, gated_rank: int | None = None
) -> None:
    for rank, conn in enumerate(conns):
        conn.send((handle, rank, num_messages, rank == gated_rank))
    for conn in conns:
        assert conn.recv() == "attached"


def _results(conns: list[Connection]) -> list[list[Any]]:
    results = []
    for conn in conns:
        assert conn.poll(HANG_GUARD_S), "a reader returned no result"
        results.append(conn.recv())
    return results


def test_two_readers_receive_1000_messages_in_order(readers: list[Connection]) -> None:
    """Every reader gets every message once, in order, while the 4-chunk ring wraps
    250 times."""
    sent = [{"step": i, "req_ids": [f"r{j}" for j in range(i % 7)]} for i in range(1000)]
    with MessageQueue.create(2, max_chunk_bytes=512, max_chunks=4) as queue:
        handle = queue.handle()
        _start_job(readers, handle, len(sent))
        for msg in sent:
            queue.enqueue(msg, timeout=HANG_GUARD_S)
        assert _results(readers) == [sent, sent]
    assert not _segment_exists(handle)


def test_small_and_oversized_messages_arrive_in_order(readers: list[Connection]) -> None:
    """Messages larger than a chunk (some larger than the whole ring) stream through it
    in order with the small ones, payloads byte for byte; the sizes include one chunk's
    payload exactly and one byte more."""
    chunk_bytes = 256
    sizes = [0, 10, 5000, 3, 100_000, 7, 2048, 1]
    sent: list[Any] = [bytes(range(256)) * (n // 256) + bytes(n % 256) for n in sizes]
    # Messages whose pickles fill one chunk's payload exactly, and one byte more.
    for extra in (0, 1):
        sent += [
            b"x" * n
            for n in range(chunk_bytes)
            if len(pickle.dumps(b"x" * n, protocol=pickle.HIGHEST_PROTOCOL))
            == chunk_bytes - 16 + extra
        ]
    assert len(sent) == len(sizes) + 2
    with MessageQueue.create(2, max_chunk_bytes=chunk_bytes, max_chunks=3) as queue:
        handle = queue.handle()
        _start_job(readers, handle, len(sent))
        for msg in sent:
            queue.enqueue(msg, timeout=HANG_GUARD_S)
        assert _results(readers) == [sent, sent]
    assert not _segment_exists(handle)


def test_slow_reader_holds_the_ring_and_the_writer_waits(readers: list[Connection]) -> None:
    """Reader 1 reads nothing until told: once the ring is full the writer cannot
    write (an enqueue with timeout 0 raises TimeoutError), also not the third piece of a
    streamed message whose first two it wrote; after the go the ring wraps many times
    and both readers get exactly the messages whose enqueue returned, the abandoned
    partial one dropped."""
    with MessageQueue.create(2, max_chunk_bytes=128, max_chunks=4) as queue:
        handle = queue.handle()
        after = [f"late-{i}" for i in range(40)]
        _start_job(readers, handle, 2 + len(after), gated_rank=1)
        queue.enqueue("m0", timeout=0)
        queue.enqueue("m1", timeout=0)
        with pytest.raises(TimeoutError):
            queue.enqueue(b"z" * 300, timeout=0)  # 3 pieces; chunk 0 still unread
        with pytest.raises(TimeoutError):
            queue.enqueue("lost", timeout=0)
        readers[1].send("go")
        for msg in after:
            queue.enqueue(msg, timeout=HANG_GUARD_S)
        expected = ["m0", "m1", *after]
        assert _results(readers) == [expected, expected]
    assert not _segment_exists(handle)


def test_timeouts_and_misuse_in_one_process() -> None:
    """TimeoutError on an empty queue and a full ring, the queue usable afterwards; a
    streamed message the writer abandoned part-way is dropped by the reader; bad
    arguments and wrong-side calls raise."""
    with MessageQueue.create(1, max_chunk_bytes=64, max_chunks=2) as writer:
        with MessageQueue.attach(writer.handle(), 0) as reader:
            with pytest.raises(TimeoutError):
                reader.dequeue(timeout=0.01)
            writer.enqueue(1)
            writer.enqueue(2)
            with pytest.raises(TimeoutError):
                writer.enqueue(3, timeout=0.01)
            assert reader.dequeue(timeout=0) == 1
            writer.enqueue(3, timeout=0)
            assert [reader.dequeue(), reader.dequeue()] == [2, 3]
            # 100 bytes stream over 3 chunks of 48 payload bytes: two fit the ring.
            with pytest.raises(TimeoutError):
                writer.enqueue(b"y" * 100, timeout=0)
            with pytest.raises(TimeoutError):
                reader.dequeue(timeout=0)  # took both pieces, the third never comes
            writer.enqueue("next")
            assert reader.dequeue() == "next"
            with pytest.raises(ValueError, match="timeout"):
                reader.dequeue(timeout=-1)
            with pytest.raises(RuntimeError, match="reader"):
                reader.enqueue(0)
            with pytest.raises(RuntimeError, match="writer"):
                writer.dequeue()
            with pytest.raises(ValueError, match="reader_rank"):
                MessageQueue.attach(writer.handle(), 1)
    with pytest.raises(RuntimeError, match="closed"):
        writer.enqueue(0)
    for field, kwargs in [
        ("n_readers", {"n_readers": 0}),
        ("max_chunk_bytes", {"n_readers": 1, "max_chunk_bytes": 16}),
        ("max_chunks", {"n_readers": 1, "max_chunks": 0}),
    ]:
        with pytest.raises(ValueError, match=field):
            MessageQueue.create(**kwargs)


def test_dequeue_any_takes_the_first_writer_that_answers() -> None:
    """The executor waits on every worker's replies at once: a silent writer (a worker
    stuck in a collective) must not hide another's answer; a dead peer still raises."""
    with MessageQueue.create(1) as silent, MessageQueue.create(1) as talker:
        with MessageQueue.attach(silent.handle(), 0) as r0, \
                MessageQueue.attach(talker.handle(), 0) as r1:
            assert not r0.poll() and not r1.poll()
            talker.enqueue(("error", "boom"))
            assert r1.poll() and not r0.poll()
            assert shm_broadcast.dequeue_any([r0, r1]) == (1, ("error", "boom"))
            silent.enqueue("late")
            assert shm_broadcast.dequeue_any([r0, r1]) == (0, "late")
            with pytest.raises(RuntimeError, match="died"):
                shm_broadcast.dequeue_any([r0, r1], is_alive=lambda: False)
    with pytest.raises(ValueError, match="queues"):
        shm_broadcast.dequeue_any([])


def test_dead_peer_raises_runtime_error_instead_of_hanging() -> None:
    """A writer waiting for a chunk a dead reader holds, and a reader waiting for a dead
    writer, raise RuntimeError from the liveness check (not the far hang guard); a
    message published before the death is still delivered."""
    dead = SPAWN.Process(target=time.sleep, args=(3600,))
    dead.start()
    dead.kill()
    dead.join()
    with MessageQueue.create(1, max_chunk_bytes=64, max_chunks=2) as writer:
        writer.is_alive = dead.is_alive
        writer.enqueue("a")
        writer.enqueue("b")
        with pytest.raises(RuntimeError, match="died"):
            writer.enqueue("c", timeout=HANG_GUARD_S)
        with MessageQueue.attach(writer.handle(), 0, is_alive=dead.is_alive) as reader:
            assert [reader.dequeue(), reader.dequeue()] == ["a", "b"]
            with pytest.raises(RuntimeError, match="died"):
                reader.dequeue(timeout=HANG_GUARD_S)


# Runs with the module linked into its folder as a top-level ``shm_broadcast`` (stdlib
# only), so that neither it nor its children import torch.
_SCENARIO = """
import multiprocessing as mp, os, pickle, subprocess, sys
import shm_broadcast as sb

UNRELATED_READER = (
    "import pickle, sys; import shm_broadcast as sb; "
    "q = sb.MessageQueue.attach(pickle.loads(bytes.fromhex(sys.argv[1])), 1); "
    "print(len(q.dequeue(timeout=60)), q.dequeue(timeout=60)); q.close()"
)

def spawned_reader(handle, conn):
    with sb.MessageQueue.attach(handle, 0) as q:
        conn.send([len(q.dequeue(timeout=60)), q.dequeue(timeout=60)])

def crashing_writer(conn):
    queue = sb.MessageQueue.create(1)
    conn.send(queue.handle())
    conn.recv()  # killed here

def exists(handle):
    return os.path.exists("/dev/shm/" + handle.name)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    writer = sb.MessageQueue.create(2, max_chunk_bytes=256, max_chunks=2)
    handle = writer.handle()
    ours, theirs = ctx.Pipe()
    spawned = ctx.Process(target=spawned_reader, args=(handle, theirs))
    spawned.start()
    unrelated = subprocess.Popen(
        [sys.executable, "-c", UNRELATED_READER, pickle.dumps(handle).hex()],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=sys.path[0])
    writer.enqueue(b"s" * 5000, timeout=60)
    writer.enqueue("done", timeout=60)
    # communicate waits for EOF, i.e. also for the reader's own resource tracker.
    out, err = unrelated.communicate(timeout=60)
    sys.stderr.write(err)
    print("unrelated", out.strip())
    print("spawned", ours.recv())
    spawned.join()
    print("after readers", exists(handle))
    writer.close()
    print("after close", exists(handle))
    crashing = ctx.Process(target=crashing_writer, args=(theirs,))
    crashing.start()
    orphan = ours.recv()
    crashing.kill()
    crashing.join()
    print("orphan", exists(orphan), sb.MessageQueue.remove_segment(orphan), exists(orphan))
"""


def test_no_segment_left_and_no_resource_tracker_complaint(tmp_path: Path) -> None:
    """A reader spawned by the writer (one resource tracker shared) and a reader in an
    unrelated process (its own tracker) attach, read and exit: the segment survives
    them, the writer's close removes it, a crashed writer's segment is removed by
    ``remove_segment``, and no process or tracker writes anything to stderr (no
    "leaked shared_memory" warning, no KeyError from a double unregister)."""
    (tmp_path / "shm_broadcast.py").symlink_to(Path(shm_broadcast.__file__))
    (tmp_path / "scenario.py").write_text(_SCENARIO)
    # The scenario and its `-c` reader import the module from the script's folder and
    # their working directory: both are off sys.path under the suite's PYTHONSAFEPATH.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    # capture_output waits for EOF: the scenario's resource tracker has exited too.
    done = subprocess.run(
        [sys.executable, str(tmp_path / "scenario.py")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "unrelated 5000 done",
        "spawned [5000, 'done']",
        "after readers True",
        "after close False",
        "orphan True True False",
    ]
    assert done.stderr == ""
