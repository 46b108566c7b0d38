"""Grammar compiles in worker processes, so that one which runs too long can be killed.

xgrammar's compiler is C++ that a Python thread cannot interrupt: a pathological regex or
schema that compiles for minutes would hold its thread (and the CPU) long after its
request failed, and new constraints would queue behind it. Each compile therefore runs in
a child process (``python -m tandem.engine.structured_output.compile_worker``) that
builds its own ``xgrammar.GrammarCompiler`` over the parent's vocabulary and answers with
the compiled grammar serialised by xgrammar (``CompiledGrammar.serialize_json``); the
parent deserialises it (a few ms) and kills the child when the time limit passes. The
next compile on that slot starts a fresh child.

Wire format on the child's stdin / stdout: frames of an 8-byte little-endian length and
that many bytes of UTF-8 JSON. The first frame to the child is the vocabulary
(``TokenizerInfo.serialize_json()``); the child answers ``{"ready": true}``. Then each job
``{"kind", "spec", "any_whitespace"}`` is answered by ``{"compiled": <json text>}`` or
``{"error": <xgrammar's message>}``.

No child outlives its engine process: each holds the read end of a pipe whose write end
only the parent holds (a "lifeline"); a thread of the child waits on it and ends the child
when it reads end-of-file, which happens when the parent is killed too (xgrammar releases
the GIL while it compiles, so that thread runs during a compile).

Engines of one process over the same vocabulary (several ``LLM`` objects, tests) share
their children: :meth:`CompileWorkers.acquire` hands out one set per (vocabulary, size),
counted, and the last :meth:`CompileWorkers.release` stops it.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from typing import IO, Any

_HEADER = 8
#: Seconds a new child may take to import xgrammar and read the vocabulary.
START_TIMEOUT_S = 120.0


class CompileFailed(Exception):
    """The compiler rejected the constraint (the message is the library's) or crashed."""


class CompileTimeout(Exception):
    """The compile ran past its time limit; its child process was killed."""


class CompileWorkers:
    """A fixed set of compile slots, each one child process started on first use.

    Use :meth:`acquire` / :meth:`release` (shared per vocabulary and size).

    Args:
        tokenizer_info_json: the vocabulary, as ``xgrammar.TokenizerInfo.serialize_json()``.
        size: slots (children, each started on first use); at most this many compiles
            run at once.

    Thread-safety: :meth:`compile` may be called from several threads; a call waits for a
    free slot.

    Attributes:
        num_started: children started so far (a killed child is replaced on next use).
        num_killed: children killed for running past their time limit.
    """

    def __init__(self, tokenizer_info_json: str, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._info = tokenizer_info_json.encode()
        # NOTE: last in, first out: the child used last is reused, so the others start
        # only when compiles overlap (each costs ~200 MiB once it imports xgrammar).
        self._idle: queue.LifoQueue[_Child] = queue.LifoQueue()
        self._children = [_Child(self._info) for _ in range(size)]
        for child in self._children:
            self._idle.put(child)
        self.num_started = 0
        self.num_killed = 0
        self._lock = threading.Lock()
        self._closed = False
        self._key = (hashlib.sha256(self._info).hexdigest(), size)
        self._holders = 0

    @classmethod
    def acquire(cls, tokenizer_info_json: str, size: int) -> CompileWorkers:
        """The process's compile workers for this vocabulary and size (made on first use);
        pair each call with one :meth:`release`."""
        key = (hashlib.sha256(tokenizer_info_json.encode()).hexdigest(), size)
        with _SHARED_LOCK:
            workers = _SHARED.get(key)
            if workers is None:
                workers = _SHARED[key] = cls(tokenizer_info_json, size)
            workers._holders += 1
            return workers

    def release(self) -> None:
        """Drop one :meth:`acquire`; the last one stops the children."""
        with _SHARED_LOCK:
            self._holders -= 1
            if self._holders > 0:
                return
            if _SHARED.get(self._key) is self:
                del _SHARED[self._key]
        self.shutdown()

    def compile(self, kind: str, spec: str, any_whitespace: bool, timeout_s: float) -> str:
        """Compile one constraint in a child; returns ``CompiledGrammar.serialize_json()``.

        Args:
            kind: ``"json"`` (``spec`` a JSON schema text), ``"regex"`` or ``"grammar"``
                (EBNF).
            spec: the constraint's text.
            any_whitespace: JSON only: free whitespace between JSON tokens.
            timeout_s: seconds the compile itself may take (a new child's start-up is not
                counted).

        Raises:
            CompileFailed: the library's message, or the child died.
            CompileTimeout: the compile took longer than ``timeout_s``.
            RuntimeError: the workers were shut down.
        """
        child = self._idle.get()
        try:
            if self._closed:
                raise RuntimeError("the grammar compile workers are shut down")
            if not child.alive():
                child.start()
                with self._lock:
                    self.num_started += 1
            try:
                return child.run({"kind": kind, "spec": spec, "any_whitespace": any_whitespace},
                                 timeout_s)
            except CompileTimeout:
                with self._lock:
                    self.num_killed += 1
                raise
        finally:
            self._idle.put(child)

    def pids(self) -> list[int]:
        """Process ids of the children running now."""
        return [c.pid for c in self._children if c.alive() and c.pid is not None]

    def shutdown(self) -> None:
        """Kill every child (a compile in flight fails with ``CompileFailed``)."""
        self._closed = True
        for child in self._children:
            child.kill()


_SHARED: dict[tuple[str, int], CompileWorkers] = {}
_SHARED_LOCK = threading.Lock()


class _Child:
    """One compile process and its pipes (used by one thread at a time)."""

    def __init__(self, info: bytes) -> None:
        self._info = info
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        self.kill()
        read_end, self._lifeline = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.engine.structured_output.compile_worker",
                 str(read_end)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(read_end,),
            )
        finally:
            os.close(read_end)
        try:
            self._send(self._info)
            self._receive(time.monotonic() + START_TIMEOUT_S)
        except (CompileTimeout, CompileFailed, OSError) as exc:
            self.kill()
            raise CompileFailed(f"the grammar compiler did not start: {exc}") from None

    def run(self, job: dict[str, Any], timeout_s: float) -> str:
        try:
            self._send(json.dumps(job).encode())
            answer = self._receive(time.monotonic() + timeout_s)
        except CompileTimeout:
            self.kill()
            raise
        except (CompileFailed, OSError) as exc:
            self.kill()
            raise CompileFailed(f"the grammar compiler failed: {exc}") from None
        if "error" in answer:
            raise CompileFailed(str(answer["error"]))
        return str(answer["compiled"])

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        lifeline, self._lifeline = self._lifeline, None
        if lifeline is not None:
            os.close(lifeline)
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _send(self, payload: bytes) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        _write_frame(self._proc.stdin, payload)

    def _receive(self, deadline: float) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        header = _read_exactly(fd, _HEADER, deadline)
        body = _read_exactly(fd, int.from_bytes(header, "little"), deadline)
        answer: dict[str, Any] = json.loads(body)
        return answer


def _write_frame(stream: IO[bytes], payload: bytes) -> None:
    stream.write(len(payload).to_bytes(_HEADER, "little"))
    stream.write(payload)
    stream.flush()


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``, waiting at most until ``deadline`` (``time.monotonic()``;
    ``None``: no limit). Raises ``CompileTimeout`` past it, ``CompileFailed`` on EOF."""
    chunks: list[bytes] = []
    while n > 0:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise CompileTimeout()
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise CompileFailed("the compile process exited")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _exit_with_parent(lifeline: int) -> None:
    """End this process as soon as the parent's end of ``lifeline`` closes."""

    def watch() -> None:
        while os.read(lifeline, 1):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def main() -> None:
    """The child's loop: read the vocabulary, then compile jobs until stdin closes.
    ``argv[1]`` is the lifeline's file descriptor."""
    _exit_with_parent(int(sys.argv[1]))
    import xgrammar as xgr

    from tandem.engine.structured_output.backend import compile_constraint, library_message

    stdin = sys.stdin.buffer.fileno()
    # Frames go to the original stdout only; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        header = _read_exactly(stdin, _HEADER, None)
        info = xgr.TokenizerInfo.deserialize_json(
            _read_exactly(stdin, int.from_bytes(header, "little"), None).decode()
        )
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        _write_frame(out, b'{"ready": true}')
        while True:
            header = _read_exactly(stdin, _HEADER, None)
            job = json.loads(_read_exactly(stdin, int.from_bytes(header, "little"), None))
            try:
                compiled = compile_constraint(
                    compiler, job["kind"], job["spec"], bool(job["any_whitespace"])
                )
                answer = {"compiled": compiled.serialize_json()}
            except (RuntimeError, ValueError, TypeError) as exc:
                answer = {"error": library_message(exc)}
            _write_frame(out, json.dumps(answer).encode())
    except (CompileFailed, BrokenPipeError):
        return  # the parent closed the pipes: done


if __name__ == "__main__":
    main()
