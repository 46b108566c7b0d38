"""Periodic background work of a service: heartbeats, registry refreshes, load polls.

One rule for all of them: the first tick runs (and is awaited) at start, so the caller
begins with a fresh view; then one tick every ``interval_s`` seconds in a background task.
A failing tick is logged and the next one runs on time: this work is advisory (Redis or a
peer may come back) and must never take the process down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


async def start_periodic(tick: Callable[[], Awaitable[None]], interval_s: float, *,
                         what: str, log: logging.Logger,
                         level: int = logging.WARNING) -> asyncio.Task[None]:
    """Run ``tick()`` now, then every ``interval_s`` seconds until the returned task is
    cancelled (:func:`stop_periodic`).

    Args:
        tick: the work; an exception from it is logged on ``log`` at ``level`` (with
            ``what`` and the error; the traceback at DEBUG) and never raised.
        interval_s: seconds between the end of one tick and the start of the next.
        what: what a tick does, for the log and the task's name.

    Returns:
        The background task (ticks after the first).
    """

    async def safe_tick() -> None:
        try:
            await tick()
        except Exception as exc:  # noqa: BLE001 - advisory work: log, retry next interval
            log.log(level, "%s failed (retrying every %.1f s): %s", what, interval_s, exc,
                    exc_info=log.isEnabledFor(logging.DEBUG))

    async def loop() -> None:
        while True:
            await asyncio.sleep(interval_s)
            await safe_tick()

    await safe_tick()
    return asyncio.create_task(loop(), name=what)


async def stop_periodic(task: asyncio.Task[None] | None) -> None:
    """Cancel a task from :func:`start_periodic` (``None``: nothing) and wait until it ends."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
