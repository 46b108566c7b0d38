"""The seam to ``ucxx``: initialisation, worker addresses, endpoints, the client loop.

ucxx keeps one UCX context per process, bound to the asyncio loop that
initialised it (completions are delivered to that loop's futures). Store nodes
initialise it on their main loop; clients on one background loop thread shared
by every client of the process (:func:`client_loop`).

Progress: a UCX progress thread that sleeps in epoll while idle, with
completions handed to asyncio futures by ucxx's notifier thread
(``enable_python_future``). On a loaded 2-core machine this beat polling
modes, which spin a core per process and starve the peer process
(docs/benchmarks.md). The mode comes from :class:`~tandem.kvstore.config.UcxOptions`, which
the entry points read from ``UCXPY_PROGRESS_MODE`` / ``UCXPY_ENABLE_PYTHON_FUTURE``;
every ``UCX_*`` variable (``UCX_TLS``...) is UCX's own and passes through unchanged.
:func:`init_ucx` is the one place that sets a default for one of them.

UCX is not fork-safe: start processes that use it with ``spawn`` or subprocess.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, Protocol, TypeVar

import numpy as np

from tandem.kvstore.config import UcxOptions

T = TypeVar("T")


class Endpoint(Protocol):
    """What we use of a ucxx endpoint: tagged sends and receives of contiguous
    buffers (coroutines; UCX errors raise), and ``abort`` (cancels what is posted)."""

    async def send(self, buffer: np.ndarray, tag: int | None = None,
                   force_tag: bool = False) -> None: ...

    async def recv(self, buffer: np.ndarray, tag: int | None = None,
                   force_tag: bool = False) -> None: ...

    def abort(self) -> None: ...


_initialised = False


def init_ucx(options: UcxOptions) -> None:
    """Initialise ucxx on the running event loop (once per process: later calls,
    whatever their ``options``, do nothing)."""
    global _initialised
    if _initialised:
        return
    # NOTE: the one UCX variable we default: ucxx sets UCX_* variables of its own
    # that UCX then warns about on every start
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    ucxx.init(progress_mode=options.progress_mode,
              enable_python_future=options.python_future
              and options.progress_mode.startswith("thread"))
    _initialised = True
    # NOTE: ucxx's notifier thread is not a daemon thread and would keep the
    # interpreter from exiting; stop it before Python joins non-daemon threads
    # (the hook concurrent.futures uses for the same purpose).
    threading._register_atexit(ucxx.stop_notifier_thread)  # type: ignore[attr-defined]


def worker_address() -> bytes:
    """This process's UCX worker address (what peers need to reach it)."""
    import ucxx

    return bytes(ucxx.get_worker_address().tobytes())


async def endpoint_to(address: bytes) -> Endpoint:
    """An endpoint to the worker at ``address``.

    NOTE: peer error handling is off: with it on, UCX excludes the shared-memory
    transports (and with it on only on the client's side, puts hung). A dead peer is
    found by UCX's own errors where its transport reports them (a TCP connection
    refused or reset: :func:`peer_gone`), by the node's process being gone for a node
    on this host (kvstore/shm.py ``segment_gone``), else by our timeouts.
    """
    import ucxx

    ep: Endpoint = await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=False
    )
    return ep


#: ucxx's errors that mean the peer is gone (refused, reset, unreachable), not a bug
#: of ours or a cancel
_PEER_GONE = ("UCXConnectionResetError", "UCXUnreachableError", "UCXEndpointTimeoutError",
              "UCXRejectedError", "UCXNotConnectedError")


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a ucxx endpoint operation) says the peer is gone.

    Seen on this host: a connection to a killed node over TCP fails with
    ``UCXConnectionResetError`` and a new one with ``UCXUnreachableError``; over the
    shared-memory transports a new one fails with ``UCXEndpointTimeoutError``.
    """
    import ucxx

    gone = tuple(getattr(ucxx.exceptions, name) for name in _PEER_GONE)
    return isinstance(exc, gone)


async def worker_recv(buf: np.ndarray, tag: int) -> None:
    """Receive one message with ``tag`` from any peer into ``buf``."""
    import ucxx

    await ucxx.recv(buf, tag=tag)


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``await aw`` with a deadline of ``timeout_s`` seconds.

    Raises:
        TimeoutError: not done in time (``aw`` is cancelled; on Python 3.10 the
            ``asyncio.TimeoutError`` of ``wait_for``).

    NOTE: on Python 3.11+ this is ``asyncio.timeout``, which awaits in the current
    task; ``wait_for`` wraps ``aw`` in a task of its own, i.e. two more trips
    through the loop per call, each handing the GIL to and from ucxx's notifier
    thread.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await aw
    return await asyncio.wait_for(aw, timeout_s)  # pragma: no cover - Python 3.10


def transports() -> str:
    """UCX transports in use (``UCX_TLS``), for logs and benchmark records."""
    import ucxx

    cfg = ucxx.get_config()
    return str(cfg.get("TLS", "all"))


class LoopThread:
    """A daemon thread running one asyncio loop with ucxx initialised on it."""

    def __init__(self, options: UcxOptions) -> None:
        self.options = options
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tandem-kvstore-ucx", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def _init() -> None:
            init_ucx(self.options)

        try:
            self.loop.run_until_complete(_init())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        """Run ``coro`` on the loop from another thread and wait for its result.

        Raises:
            RuntimeError: called from the loop thread itself (would deadlock).
            TimeoutError: not done within ``timeout_s`` (the coroutine is cancelled).
        """
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("blocking KV store call made from the store's own loop thread")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise


_loop_lock = threading.Lock()
_loop: LoopThread | None = None


def client_loop(options: UcxOptions) -> LoopThread:
    """The process's one client loop thread (started on first use, with UCX set up by
    that first caller's ``options``).

    NOTE: a process-wide singleton on purpose: ucxx allows one context per
    process and binds it to the loop that initialised it.
    """
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = LoopThread(options)
        return _loop
