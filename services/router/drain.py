"""The router's graceful shutdown: stop admitting, let open requests finish, then end them.

On SIGTERM (Kubernetes' ``preStop``, ``tandem up``'s Ctrl-C) :meth:`Drain.run`:

1. marks the router draining: ``/ready`` answers 503 (load balancers stop sending) and a
   new generation request gets a 503 with ``Retry-After`` (another replica may take it);
2. waits up to ``grace_s`` for the open generation requests to finish on their own;
3. ends what is left: a stream gets ``data: {"error": ...}`` and ``data: [DONE]``, a
   non-streamed request a 503 JSON error, so no client sees a bare close that looks like a
   complete answer.

Then the HTTP server stops (uvicorn's own shutdown finds nothing open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from tandem.services.router.errors import OpenAIError

logger = logging.getLogger(__name__)

#: After the grace period, how long the ended requests get to write their last bytes.
FLUSH_S = 2.0


def shutting_down_error() -> OpenAIError:
    """What a request that the shutdown ends, or one that arrives during it, gets."""
    return OpenAIError("the router is shutting down; retry the request", status_code=503,
                       retry_after_s=1, code="shutting_down")


class Drain:
    """Counts the open generation requests and ends them when the router stops.

    Use :meth:`request` around each generation request (streams included, until their last
    byte); :attr:`expired` is set, and the :meth:`on_expire` callbacks called, when the grace
    period is over. Belongs to one event loop.
    """

    def __init__(self) -> None:
        self.draining = False
        self.expired = asyncio.Event()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next_id = 0
        self._open = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_open(self) -> int:
        """Generation requests open now."""
        return self._open

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        """One generation request's lifetime.

        Raises:
            OpenAIError: 503 ``shutting_down`` when the router is draining.
        """
        if self.draining:
            raise shutting_down_error()
        self._open += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._open -= 1
            if self._open == 0:
                self._idle.set()

    def on_expire(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the grace period ends (at once if it has); returns the
        function that unregisters it."""
        if self.expired.is_set():
            callback()
            return lambda: None
        key = self._next_id
        self._next_id += 1
        self._callbacks[key] = callback

        def unregister() -> None:
            self._callbacks.pop(key, None)

        return unregister

    async def run(self, grace_s: float) -> None:
        """Drain: refuse new requests, wait up to ``grace_s`` seconds for the open ones,
        end the rest, and return once they wrote their last bytes (or ``FLUSH_S`` passed)."""
        self.draining = True
        start = time.monotonic()
        logger.info("draining: %d open requests get %.1f s to finish", self._open, grace_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        left = self._open
        self.expired.set()
        for callback in list(self._callbacks.values()):
            callback()
        self._callbacks.clear()
        if left:
            logger.warning("ending %d requests still open after %.1f s", left,
                           time.monotonic() - start)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), FLUSH_S)
