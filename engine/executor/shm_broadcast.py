"""A shared-memory message queue with one writer and many readers: how a multi-process
executor broadcasts each step's scheduler output to every worker (and, with one reader,
how a worker hands its output back).

Design (after vLLM's ``ShmRingBuffer`` / ``MessageQueue`` in
``vllm/distributed/device_communicators/shm_broadcast.py``; written anew here):

- One POSIX shared-memory segment holds a ring of ``max_chunks`` chunks of
  ``max_chunk_bytes`` each, then one metadata row per chunk: a *written* flag and one
  *read* flag per reader, one byte each.
- The writer fills chunks in ring order. A chunk is free when it was never written or
  when every reader has set its read flag on it; the writer clears the written flag,
  writes the piece, clears the read flags and sets the written flag again, last. Reader
  ``r`` takes its next chunk once that chunk's written flag is set and its own read flag
  is clear, copies the bytes out and sets its read flag. So every reader gets every
  message in order, and the writer waits rather than overwrite a chunk some reader has
  not read. A reader that attaches late still gets everything from the first message:
  until it has read them, the writer cannot reuse those chunks.
- Messages are pickled. Every chunk starts with a 16-byte header (message length, offset
  of this piece in it, both in bytes). A message longer than one chunk's payload
  (``max_chunk_bytes - 16``) is streamed over consecutive chunks, the reader assembling
  the pieces; it may be larger than the whole ring, since readers free chunks as the
  writer fills them. NOTE: streaming, not vLLM's side channel (a socket there, a one-off
  segment per message here would be the shm analogue): it creates nothing that could
  leak when a process dies mid-message, needs no "last reader unlinks" protocol, and
  keeps oversized messages in order with the rest for free.
- An ``enqueue`` that times out (or finds a dead peer) part-way through a streamed
  message leaves its first pieces in the ring; readers drop such a partial message when
  the next message's first piece (offset 0) arrives. A failed ``enqueue`` thus delivers
  nothing, and the queue stays usable.

Memory ordering. Each flag is one byte, so a flag store or load is never torn. The
writer publishes a piece by writing its bytes, then a fence, then the flags; a reader
checks the flags, fences, copies the bytes, fences, then sets its read flag (so the
writer never overwrites bytes still being copied). On x86-64 (TSO) stores become
visible in program order and loads are not reordered with older loads, so program order
alone would do; on ARM64 they may be reordered, hence ``_memory_fence``: a
``threading.Lock`` acquire and release, i.e. POSIX semaphore/mutex calls, which POSIX
(Base Definitions, 4.12 "Memory Synchronization") requires to synchronise memory, the
same device vLLM uses. Readers and writer are separate processes, so the GIL orders
nothing between them; within a process an end of the queue belongs to one thread (the
class is not thread-safe).

Waiting. A waiting side polls its flag: it yields the CPU in a tight loop for
``_SPIN_S`` (a reply that comes back within it costs no sleep), then sleeps an eighth
of the time waited so far, at least ``_MIN_SLEEP_S`` and at most ``_ACTIVE_MAX_SLEEP_S``;
after ``_IDLE_AFTER_S`` without a message (no requests) it sleeps ``_IDLE_SLEEP_S``.
So a wait overshoots by at most ~1/8 of its length plus the kernel's timer slack
(~50 us), and by at most ~0.25 ms while steps flow (a step every ~10-30 ms: about 1-2%);
a waiting process wakes at most ~5,000 times a second instead of spinning a core, 500
when idle, and the first step after an idle second pays up to ~2 ms. While it waits, a
side calls its ``is_alive`` check at most every ``_LIVENESS_INTERVAL_S`` and raises
``RuntimeError`` when the check says the peer died, instead of hanging.

Resource tracker (Python 3.11). ``SharedMemory(name=...)`` registers the segment with
the attaching process's resource tracker as if it had created it; that tracker unlinks
it (and warns about a "leaked shared_memory object") when its processes exit. The
tracker keeps a set, not a count, of names. Processes started by ``multiprocessing``
(spawn, fork, forkserver) share their parent's tracker: there the reader's
registration is a no-op and must *not* be undone (an unregister would drop the
writer's entry too, and the writer's own unlink would then fail inside the tracker with
a KeyError). A reader in an unrelated process has its own tracker and must unregister,
or the segment is unlinked under the writer when the reader exits. ``attach`` tells the
two apart by the identity (device, inode) of the tracker's pipe, recorded by the writer
in the ``Handle``: an inherited pipe is the same pipe. The writer's registration stays,
so the tracker still unlinks the segment if the writer dies without ``close``.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from types import TracebackType
from typing import Any

# Header of every chunk: the whole message's pickled length and this piece's offset in
# it, both in bytes.
_HEADER = struct.Struct("<QQ")
# Waiting (module docstring), in seconds.
_SPIN_S = 1e-4
_MIN_SLEEP_S = 2e-5
_ACTIVE_MAX_SLEEP_S = 2e-4
_IDLE_AFTER_S = 1.0
_IDLE_SLEEP_S = 2e-3
_LIVENESS_INTERVAL_S = 0.05

_fence_lock = threading.Lock()


def _memory_fence() -> None:
    """Order this process's shared-memory accesses before the fence ahead of those after
    it (see the module docstring: a lock's acquire/release synchronises memory)."""
    _fence_lock.acquire()
    _fence_lock.release()


def _tracker_pipe_id() -> tuple[int, int] | None:
    """(device, inode) of this process's resource tracker pipe; ``None`` where there is
    no tracker for shared memory (Windows frees a segment with its last handle)."""
    if os.name != "posix":
        return None
    # NOTE: getfd starts the tracker if needed; SharedMemory would start it anyway.
    fd = resource_tracker.getfd()
    assert fd is not None, "resource tracker did not start"
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino)


def wait_until(
    ready: Callable[[], bool],
    deadline: float | None,
    is_alive: Callable[[], bool] | None,
    what: str,
) -> None:
    """Return once ``ready()`` holds: spin, then back off (module docstring), checking
    ``is_alive`` every ``_LIVENESS_INTERVAL_S`` while waiting.

    Raises:
        TimeoutError: past ``deadline`` (``time.monotonic`` seconds; None: no limit).
        RuntimeError: ``is_alive`` said the peer died.
    """
    if ready():
        return
    start = time.monotonic()
    next_liveness_check = start
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"timed out {what}")
        if is_alive is not None and now >= next_liveness_check:
            if not is_alive():
                raise RuntimeError(f"peer process died while {what}")
            next_liveness_check = now + _LIVENESS_INTERVAL_S
        waited_s = now - start
        if waited_s < _SPIN_S:
            os.sched_yield()
        elif waited_s < _IDLE_AFTER_S:
            time.sleep(min(max(waited_s / 8, _MIN_SLEEP_S), _ACTIVE_MAX_SLEEP_S))
        else:
            time.sleep(_IDLE_SLEEP_S)
        if ready():
            return


def dequeue_any(
    queues: Sequence[MessageQueue], is_alive: Callable[[], bool] | None = None
) -> tuple[int, Any]:
    """The next message of whichever of ``queues`` (readers' ends) has one first:
    ``(index in queues, message)``; a caller waiting on several writers (the executor
    on its workers' replies) sees the first answer, an error included, without
    blocking behind a writer that will never answer.

    Raises:
        RuntimeError: ``is_alive`` said a peer died.
        ValueError: ``queues`` is empty.
    """
    if not queues:
        raise ValueError("queues must not be empty")
    found: list[int] = []

    def ready() -> bool:
        for i, q in enumerate(queues):
            if q.poll():
                found.append(i)
                return True
        return False

    wait_until(ready, None, is_alive, "waiting for any of several writers")
    i = found[-1]
    return i, queues[i].dequeue()


@dataclass(frozen=True)
class Handle:
    """What a reader needs to attach to a queue; small and picklable.

    Attributes:
        name: the shared-memory segment's name (``SharedMemory.name``).
        n_readers: number of readers; ranks are ``0 .. n_readers - 1``.
        max_chunk_bytes: bytes per chunk, header included.
        max_chunks: number of chunks in the ring.
        tracker_pipe_id: (device, inode) of the writer's resource tracker pipe, or
            ``None``; tells ``attach`` whether it shares the writer's tracker.
    """

    name: str
    n_readers: int
    max_chunk_bytes: int
    max_chunks: int
    tracker_pipe_id: tuple[int, int] | None


class MessageQueue:
    """One writer, ``n_readers`` readers, messages delivered to every reader in order
    (vLLM's ``MessageQueue`` over its ``ShmRingBuffer``; see the module docstring).

    The writer builds it with ``create`` and owns the segment (``close`` unlinks it);
    each reader, usually in another process, builds it with ``attach(handle,
    reader_rank)``. Readers must attach before the writer closes. Messages still unread
    when the writer closes are lost to readers that have not attached yet.

    ``is_alive``: an optional check, called while waiting, that returns False once the
    peer side cannot make progress (for the writer: some reader died; for a reader: the
    writer died); the wait then raises ``RuntimeError``. It may be reassigned.
    """

    def __init__(
        self,
        shm: shared_memory.SharedMemory,
        handle: Handle,
        reader_rank: int | None,
        is_alive: Callable[[], bool] | None,
    ) -> None:
        """Private: use ``create`` or ``attach``."""
        self._shm = shm
        assert shm.buf is not None, "shared memory segment is closed"
        self._buf: memoryview = shm.buf
        self._handle = handle
        self._reader_rank = reader_rank
        self.is_alive = is_alive
        self._chunk_bytes = handle.max_chunk_bytes
        self._num_chunks = handle.max_chunks
        self._payload_bytes = handle.max_chunk_bytes - _HEADER.size
        self._meta_offset = handle.max_chunks * handle.max_chunk_bytes
        self._meta_row_bytes = 1 + handle.n_readers
        self._all_read = b"\x01" * handle.n_readers
        self._none_read = bytes(handle.n_readers)
        self._idx = 0  # next chunk this side writes or reads
        # A streamed message being assembled (reader side): its bytes and how many of
        # them have arrived; kept across a dequeue that timed out part-way.
        self._partial: bytearray | None = None
        self._partial_filled = 0
        self._closed = False

    @staticmethod
    def _segment_bytes(n_readers: int, max_chunk_bytes: int, max_chunks: int) -> int:
        return max_chunks * max_chunk_bytes + max_chunks * (1 + n_readers)

    @classmethod
    def create(
        cls,
        n_readers: int,
        max_chunk_bytes: int = 1 << 20,
        max_chunks: int = 8,
        is_alive: Callable[[], bool] | None = None,
    ) -> MessageQueue:
        """The writer's end: a new segment of ``max_chunks * (max_chunk_bytes + 1 +
        n_readers)`` bytes, owned by this object.

        Args:
            n_readers: number of readers (>= 1).
            max_chunk_bytes: bytes per chunk, the 16-byte header included (> 16); a
                message whose pickle is longer is streamed over several chunks.
            max_chunks: chunks in the ring (>= 1): how many messages the writer can be
                ahead of the slowest reader.
            is_alive: see the class docstring.

        Raises:
            ValueError: naming the field out of range.
            OSError: when the segment cannot be created (e.g. /dev/shm full).
        """
        if n_readers < 1:
            raise ValueError(f"n_readers must be >= 1, got {n_readers}")
        if max_chunk_bytes <= _HEADER.size:
            raise ValueError(
                f"max_chunk_bytes must be > {_HEADER.size} (the chunk header), "
                f"got {max_chunk_bytes}"
            )
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        size = cls._segment_bytes(n_readers, max_chunk_bytes, max_chunks)
        shm = shared_memory.SharedMemory(create=True, size=size)
        handle = Handle(shm.name, n_readers, max_chunk_bytes, max_chunks, _tracker_pipe_id())
        queue = cls(shm, handle, None, is_alive)
        # A new segment is zero-filled already; the explicit clear states the start state.
        queue._buf[queue._meta_offset : size] = bytes(size - queue._meta_offset)
        return queue

    @classmethod
    def attach(
        cls,
        handle: Handle,
        reader_rank: int,
        is_alive: Callable[[], bool] | None = None,
    ) -> MessageQueue:
        """Reader ``reader_rank``'s end of the queue ``handle`` names.

        Raises:
            ValueError: ``reader_rank`` outside ``0 .. handle.n_readers - 1``, or a
                segment smaller than the handle says.
            FileNotFoundError: the segment no longer exists (the writer closed).
        """
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(
                f"reader_rank must be in [0, {handle.n_readers}), got {reader_rank}"
            )
        shm = shared_memory.SharedMemory(name=handle.name)
        if handle.tracker_pipe_id is not None and _tracker_pipe_id() != handle.tracker_pipe_id:
            # Our own tracker registered the segment just now; it is the writer's to
            # unlink (module docstring). SharedMemory registers POSIX names with their
            # leading slash.
            resource_tracker.unregister("/" + shm.name, "shared_memory")
        need = cls._segment_bytes(handle.n_readers, handle.max_chunk_bytes, handle.max_chunks)
        if shm.size < need:
            shm.close()
            raise ValueError(f"segment {handle.name} has {shm.size} bytes, handle needs {need}")
        return cls(shm, handle, reader_rank, is_alive)

    @staticmethod
    def remove_segment(handle: Handle) -> bool:
        """Unlink the segment of a queue whose writer died without ``close`` (e.g. a
        crashed worker's reply queue). Call it only once the writer is known dead.

        Returns:
            True when this call removed the segment, False when it was already gone.
        """
        try:
            shm = shared_memory.SharedMemory(name=handle.name)
        except FileNotFoundError:
            return False
        # Attaching registered it with our tracker (or found the dead writer's entry in
        # a shared one); unlink unregisters it again, so no tracker is left holding it.
        shm.close()
        shm.unlink()
        return True

    def handle(self) -> Handle:
        """The picklable handle readers attach with."""
        return self._handle

    @property
    def is_writer(self) -> bool:
        return self._reader_rank is None

    @property
    def n_readers(self) -> int:
        return self._handle.n_readers

    def _check_usable(self, as_writer: bool, timeout: float | None) -> float | None:
        """The absolute deadline (``time.monotonic`` seconds) for ``timeout``."""
        if self._closed:
            raise RuntimeError("message queue is closed")
        if as_writer != self.is_writer:
            role = "writer" if self.is_writer else "reader"
            op = "enqueue" if as_writer else "dequeue"
            raise RuntimeError(f"{op} on the {role}'s end of a message queue")
        if timeout is None:
            return None
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
        return time.monotonic() + timeout

    def _wait(self, ready: Callable[[], bool], deadline: float | None, what: str) -> None:
        wait_until(ready, deadline, self.is_alive, what)

    def poll(self) -> bool:
        """Reader's end: whether a message (its first piece) is there to ``dequeue``
        now; never waits.

        Raises:
            RuntimeError: on the writer's end or after ``close``.
        """
        self._check_usable(False, None)
        assert self._reader_rank is not None
        row = self._meta_offset + self._idx * self._meta_row_bytes
        return self._buf[row] == 1 and self._buf[row + 1 + self._reader_rank] == 0

    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Pickle ``obj`` and publish it to every reader; blocks while the ring is full
        (the slowest reader ``max_chunks`` messages behind), streaming an oversized
        message chunk by chunk as readers free them.

        Args:
            obj: any picklable object.
            timeout: seconds to wait in all (None: no limit; 0: only if room now).

        Raises:
            TimeoutError: the readers did not free room in time; nothing is delivered.
            RuntimeError: ``is_alive`` reported a dead reader; or on a reader's end or
                after ``close``.
            ValueError: ``timeout`` < 0.
            pickle.PicklingError: ``obj`` cannot be pickled.
        """
        deadline = self._check_usable(True, timeout)
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        offset = 0
        while True:
            n = min(self._payload_bytes, len(data) - offset)
            self._write_piece(data[offset : offset + n], len(data), offset, deadline)
            offset += n
            if offset >= len(data):
                return

    def _write_piece(
        self, piece: memoryview, msg_bytes: int, offset: int, deadline: float | None
    ) -> None:
        buf = self._buf
        row = self._meta_offset + self._idx * self._meta_row_bytes
        flags = slice(row + 1, row + self._meta_row_bytes)

        def free() -> bool:
            return buf[row] == 0 or buf[flags] == self._all_read

        self._wait(free, deadline, f"waiting for readers to free chunk {self._idx}")
        # Every reader's copy of the old piece happened before its read flag was set.
        _memory_fence()
        buf[row] = 0  # a writer that dies mid-write leaves no half-written valid chunk
        start = self._idx * self._chunk_bytes
        _HEADER.pack_into(buf, start, msg_bytes, offset)
        body = start + _HEADER.size
        buf[body : body + len(piece)] = piece
        _memory_fence()  # the piece is visible before the flags that publish it
        buf[flags] = self._none_read
        buf[row] = 1
        self._idx = (self._idx + 1) % self._num_chunks

    def dequeue(self, timeout: float | None = None) -> Any:
        """The next message, unpickled; blocks until the writer publishes it.

        Args:
            timeout: seconds to wait in all (None: no limit; 0: only if one is there).
                A timeout part-way through a streamed message keeps the pieces read so
                far; the next ``dequeue`` resumes it.

        Raises:
            TimeoutError: no (whole) message in time.
            RuntimeError: ``is_alive`` reported the writer dead; or on the writer's
                end or after ``close``.
            ValueError: ``timeout`` < 0.
        """
        deadline = self._check_usable(False, timeout)
        assert self._reader_rank is not None
        buf = self._buf
        while True:
            row = self._meta_offset + self._idx * self._meta_row_bytes
            flag = row + 1 + self._reader_rank

            def ready(row: int = row, flag: int = flag) -> bool:
                return buf[row] == 1 and buf[flag] == 0

            self._wait(ready, deadline, f"waiting for the writer on chunk {self._idx}")
            _memory_fence()  # the piece is read only after its flags were seen
            start = self._idx * self._chunk_bytes
            msg_bytes, offset = _HEADER.unpack_from(buf, start)
            n = min(self._payload_bytes, msg_bytes - offset)
            assert 0 <= offset < msg_bytes and n > 0, (
                f"corrupt chunk header: offset {offset}, message bytes {msg_bytes}"
            )
            body = start + _HEADER.size
            whole: bytes | bytearray | None = None
            if offset == 0 and n == msg_bytes:
                whole = bytes(buf[body : body + n])
                self._partial = None  # a message the writer abandoned part-way
            else:
                if offset == 0:
                    self._partial = bytearray(msg_bytes)
                    self._partial_filled = 0
                assert (
                    self._partial is not None
                    and len(self._partial) == msg_bytes
                    and offset == self._partial_filled
                ), f"streamed piece at offset {offset} out of order"
                self._partial[offset : offset + n] = buf[body : body + n]
                self._partial_filled += n
                if self._partial_filled == msg_bytes:
                    whole, self._partial = self._partial, None
            _memory_fence()  # the copy is done before the writer may reuse the chunk
            buf[flag] = 1
            self._idx = (self._idx + 1) % self._num_chunks
            if whole is not None:
                return pickle.loads(whole)

    def close(self) -> None:
        """Release this end; the writer's also unlinks the segment (readers that are
        attached keep their mapping until they close). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shm.close()
        if self.is_writer:
            self._shm.unlink()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
