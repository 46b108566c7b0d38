"""Several async streams as one, in arrival order: the router's fan-in.

A request with ``n`` completions runs ``n`` streams (``engine.fan_out``), and a completions
request with several prompts runs one generation per prompt; both are read as one stream
through :func:`merge_streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TypeVar

T = TypeVar("T")

_DONE = object()  # a stream's end, in the queue


async def merge_streams(
    streams: Sequence[AsyncGenerator[T, None]],
) -> AsyncGenerator[T, None]:
    """Items of every stream, each as soon as it arrives.

    Each stream runs in its own task. The first error of any stream is raised here (the
    others are cancelled); closing this iterator early cancels every stream still running,
    so their ``finally`` blocks (RPC cancellation) run.

    Raises:
        BaseException: whatever a stream raised first (not ``CancelledError``).
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
            queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        num_done = 0
        while num_done < len(tasks):
            got = await queue.get()
            if got is _DONE:
                num_done += 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
