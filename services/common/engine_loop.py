"""Run an EngineCore in one dedicated thread and bridge it to asyncio.

The engine is single-threaded (scheduler, block pool and model runner are not
thread-safe), so every call into it happens in the engine thread, its construction
included when it is made by :meth:`EngineLoop.launch`:

* RPC handlers (event loop) post *commands* (add a request, abort, read stats)
  to a deque and wake the thread; the result or exception comes back through a
  ``concurrent.futures.Future`` awaited with ``asyncio.wrap_future``.
* The thread steps the engine while it has unfinished requests and hands each
  step's outputs to the per-request ``asyncio.Queue`` of the handler that owns
  the request, with one ``loop.call_soon_threadsafe`` per step. Each output
  travels with the monotonic time its step ended (``StampedOutput``), so a
  handler can tell how long the hand-off took; a handler slower than the engine
  reads every output that is ready at once (:meth:`RequestStream.batches`).

Cancellation: a :class:`RequestStream` that is closed before its request
finished (client cancelled, deadline passed, handler error) aborts the request
in the engine, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from tandem.engine.errors import EngineDeadError
from tandem.engine.outputs import EngineCoreOutput
from tandem.engine.request import Request
from tandem.services.common.errors import ShuttingDownError

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: One engine output and the ``time.monotonic_ns()`` at which its step ended.
StampedOutput = tuple[EngineCoreOutput, int]

#: How long the thread waits when a step ran no forward pass (the engine only
#: waits for remote KV loads or saves), in seconds. Finished transfers wake the
#: thread at once (:meth:`EngineLoop.wake`); this only bounds a missed wake-up.
_IDLE_POLL_S = 0.005

#: How long :meth:`EngineLoop.stats` waits for the engine thread before it answers with
#: the last snapshot (seconds). One step can take tens of seconds (a long prefill on a
#: CPU); load reports and heartbeats must not wait that long.
STATS_MAX_WAIT_S = 0.25


class EngineLoop:
    """Owns the engine thread.

    Args:
        engine: an ``EngineCore`` (token-in, token-out); only touched by the thread.
        loop: the asyncio loop the RPC handlers run on.
        has_pending_transfers: True while KV transfers are in flight; the thread
            keeps stepping then (so finished transfers free their blocks) even
            when the scheduler has no unfinished request.
        on_engine_dead: called on the event loop, once, when a step raised
            ``EngineDeadError`` (a worker process died); the service then shuts down.
            In-flight requests get the error; new ones get it too.

    Thread-safety: every public method is called from the event loop thread.
    """

    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        has_pending_transfers: Callable[[], bool] | None = None,
        on_engine_dead: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_engine_dead = on_engine_dead
        #: The ``EngineDeadError`` that stopped the engine, else ``None``.
        self.dead: EngineDeadError | None = None
        self._has_pending_transfers = has_pending_transfers or (lambda: False)
        self._loop = loop
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake = threading.Event()
        # request_id -> queue of StampedOutput | BaseException; engine thread only.
        self._queues: dict[str, asyncio.Queue[StampedOutput | BaseException]] = {}
        self._accepting = True
        #: Set once this loop takes no new requests (draining, shutting down): calls that
        #: carry many requests (DecodeStream) then end as soon as theirs are over.
        self.draining = asyncio.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats: Any = None  # last SchedulerStats read; event loop only
        self._stats_pending: asyncio.Future[Any] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    @classmethod
    async def launch(
        cls,
        build: Callable[[], Any],
        loop: asyncio.AbstractEventLoop,
        has_pending_transfers_of: Callable[[Any], Callable[[], bool] | None] = lambda _: None,
        on_engine_dead: Callable[[], None] | None = None,
    ) -> EngineLoop:
        """Start the engine thread, build the engine in it, and return the running loop.

        ``build()`` (e.g. ``EngineCore(config)``: load, warm up, profile the KV cache)
        runs in the thread that then steps the engine, so every forward pass of the
        process runs on that one thread. NOTE: OpenMP (torch's and tandem's kernels) keeps
        a pool of worker threads per thread that ever ran a parallel region. An engine
        built in another thread (``asyncio.to_thread``) leaves that thread's idle pool
        behind; GNU OpenMP then counts more threads than CPUs and stops spinning at its
        barriers, so each of the dozens of barriers of a decode step sleeps and wakes
        through the kernel instead.

        Args:
            build: makes the engine; called once, in the engine thread.
            loop: the asyncio loop the RPC handlers run on.
            has_pending_transfers_of: given the built engine, the ``has_pending_transfers``
                callback (see the class), or ``None``.
            on_engine_dead: as in the class.

        Raises:
            Exception: what ``build()`` raised (the thread has ended then).
        """
        built: concurrent.futures.Future[EngineLoop] = concurrent.futures.Future()

        def main() -> None:
            try:
                engine = build()
                engine_loop = cls(engine, loop, has_pending_transfers_of(engine), on_engine_dead)
                engine_loop._thread = threading.current_thread()  # this thread steps it
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                built.set_exception(exc)
                return
            built.set_result(engine_loop)
            engine_loop._run()

        threading.Thread(target=main, name="engine-loop", daemon=True).start()
        return await asyncio.wrap_future(built)

    def start(self) -> None:
        """Start the engine thread (no-op for a loop made by :meth:`launch`, already running)."""
        if not self._thread.is_alive():
            self._thread.start()

    def stop_accepting(self) -> None:
        """New requests get :class:`ShuttingDownError` (UNAVAILABLE); in-flight ones continue."""
        self._accepting = False
        self.draining.set()

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (approximate: read across threads)."""
        return len(self._queues)

    async def shutdown(self) -> None:
        """Abort what is left, stop the thread and wait for it (blocks the loop at most briefly)."""
        self._accepting = False
        self.draining.set()
        if self._thread.is_alive():
            await self.call(self._abort_all)
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 30.0)

    # -- commands ------------------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the engine thread and return its result (or raise its exception)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

        self._post(job)
        return await asyncio.wrap_future(future)

    async def stats(self, max_wait_s: float = STATS_MAX_WAIT_S) -> Any:
        """The engine's ``SchedulerStats``, never waiting long for a step in progress.

        Reads the stats in the engine thread; if that does not answer within
        ``max_wait_s`` (the thread is inside a long step) returns the last snapshot
        instead, and the pending read refreshes the snapshot when the step ends. Only
        the very first read waits for the thread. At most one read is queued at a time.

        Raises:
            ShuttingDownError: the engine thread is not running.
        """
        if self._stats_pending is None:
            self._stats_pending = asyncio.ensure_future(self.call(self.engine.get_stats))
            self._stats_pending.add_done_callback(self._stats_done)
        pending = self._stats_pending
        if self._stats is None:
            return await asyncio.shield(pending)
        await asyncio.wait({pending}, timeout=max_wait_s)
        return self._stats

    def _stats_done(self, future: asyncio.Future[Any]) -> None:
        self._stats_pending = None
        if not future.cancelled() and future.exception() is None:
            self._stats = future.result()

    def wake(self) -> None:
        """Make the thread step now (thread-safe; e.g. a KV transfer finished)."""
        self._wake.set()

    def _post(self, job: Callable[[], None]) -> None:
        if self._stop or not self._thread.is_alive():
            raise ShuttingDownError("engine loop is not running")
        self._commands.append(job)
        self._wake.set()

    async def add_request(self, request: Request) -> RequestStream:
        """Add ``request`` to the engine; return the stream of its outputs.

        Raises:
            ShuttingDownError: the server is draining.
            ValueError: the engine rejected the request (the message names the
                field), or the request id is already in flight.
        """
        if not self._accepting:
            raise ShuttingDownError("server is shutting down")
        queue: asyncio.Queue[StampedOutput | BaseException] = asyncio.Queue()
        # The store lookup runs while the current step does, not after it.
        self.engine.prefetch_kv(request)
        try:
            await self.call(self._add, request, queue)
        except asyncio.CancelledError:
            # The add may have run already: abort it (queued after it, so it applies).
            self.abort_nowait(request.request_id)
            try:
                self._post(lambda: self.engine.drop_prefetch_kv(request))
            except ShuttingDownError:
                pass
            raise
        return RequestStream(self, request.request_id, queue)

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request (fire and forget; safe from a cancelled task)."""
        try:
            self._post(lambda: self._abort([request_id]))
        except ShuttingDownError:
            pass  # the thread is gone: nothing holds blocks any more

    # -- engine thread -------------------------------------------------------------------------

    def _add(self, request: Request, queue: asyncio.Queue) -> None:
        try:
            if request.request_id in self._queues:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self.engine.add_request(request)
        except BaseException:
            self.engine.drop_prefetch_kv(request)
            raise
        self._queues[request.request_id] = queue

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._queues]
        for rid in live:
            del self._queues[rid]
        if live:
            self.engine.abort_requests(live)

    def _abort_all(self) -> None:
        ids = list(self._queues)
        queues = [self._queues[rid] for rid in ids]
        self._abort(ids)
        exc = ShuttingDownError("server shut down before the request finished")
        self._deliver([(q, exc) for q in queues])

    def _deliver(self, items: list[tuple[asyncio.Queue, Any]]) -> None:
        if not items:
            return

        def put_all() -> None:
            for queue, item in items:
                queue.put_nowait(item)

        try:
            self._loop.call_soon_threadsafe(put_all)
        except RuntimeError:
            logger.warning("event loop closed; dropped %d engine outputs", len(items))

    def _run(self) -> None:
        while True:
            self._wake.clear()
            while self._commands:
                job = self._commands.popleft()
                try:
                    job()
                except Exception:  # noqa: BLE001 - fire-and-forget jobs (aborts) only
                    logger.exception("engine command failed")
            if self._stop:
                return
            if not self.engine.has_unfinished_requests() and not self._has_pending_transfers():
                self._wake.wait()
                continue
            # A step with batches in flight submits one or waits for one: never idle.
            progress_before = (self.engine.num_steps, self.engine.num_batches_in_flight)
            try:
                outputs = self.engine.step()
            except EngineDeadError as exc:
                logger.error("engine is dead (%s); failing all in-flight requests", exc)
                self.dead = exc
                self._accepting = False
                queues = list(self._queues.values())
                self._queues.clear()
                self._deliver([(q, exc) for q in queues])
                if self._on_engine_dead is not None:
                    self._loop.call_soon_threadsafe(self._on_engine_dead)
                return
            except Exception as exc:  # noqa: BLE001 - handed to every waiting handler
                logger.exception("engine step failed; failing all in-flight requests")
                queues = list(self._queues.values())
                try:
                    self._abort(list(self._queues))
                except Exception:  # noqa: BLE001 - the engine is already broken
                    logger.exception("abort after a failed step failed")
                    self._queues.clear()
                self._deliver([(q, exc) for q in queues])
                continue
            step_end_ns = time.monotonic_ns()
            items = []
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is None:
                    continue  # aborted by its handler meanwhile
                # The engine failed the request (its grammar did not compile, ...):
                # the handler sees the RequestError, which names the field.
                items.append((queue, out.error if out.error is not None
                              else (out, step_end_ns)))
                if out.finished:
                    del self._queues[out.request_id]
            self._deliver(items)
            if (self.engine.num_steps, self.engine.num_batches_in_flight) == progress_before:
                # No forward ran (only waiting for KV transfers): don't spin.
                self._wake.wait(_IDLE_POLL_S)


class RequestStream:
    """The outputs of one request, consumed by its RPC handler.

    Use as an async context manager: leaving it before the request finished
    aborts the request (so cancellation frees its blocks).
    """

    def __init__(self, engine_loop: EngineLoop, request_id: str, queue: asyncio.Queue) -> None:
        self.request_id = request_id
        self._engine_loop = engine_loop
        self._queue = queue
        self.finished = False
        self._error: BaseException | None = None
        #: ``time.monotonic_ns()`` when the first output arrived.
        self.first_output_ns: int | None = None

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self.finished:
            self._engine_loop.abort_nowait(self.request_id)

    def __aiter__(self) -> AsyncIterator[EngineCoreOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[EngineCoreOutput]:
        async for batch in self.batches():
            for out, _ in batch:
                yield out

    async def batches(self) -> AsyncIterator[list[StampedOutput]]:
        """The outputs, in order, grouped as they are ready: each list holds every output
        queued when the consumer came back for more (one while it keeps up with the
        engine, several when it fell behind), each with its step's end
        (``time.monotonic_ns()``). Ends after the finished output.

        Raises:
            BaseException: what the engine failed the request with (after the outputs
                queued before it).
        """
        queue = self._queue
        while not self.finished:
            if self._error is not None:
                self.finished = True  # the engine already dropped the request
                raise self._error
            item = await queue.get()
            batch: list[StampedOutput] = []
            while True:
                if isinstance(item, BaseException):
                    self._error = item
                    break
                batch.append(item)
                if item[0].finished:
                    self.finished = True
                    break
                if queue.empty():
                    break
                item = queue.get_nowait()
            if batch:
                if self.first_output_ns is None:
                    self.first_output_ns = time.monotonic_ns()
                yield batch
