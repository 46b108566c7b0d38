"""The engine service builds its engine in the thread that then steps it.

Bug: `tandem serve` built the ``EngineCore`` in a thread of asyncio's default executor
(``asyncio.to_thread``), which stays alive, and stepped it in the engine loop's own
thread. OpenMP keeps a pool of worker threads per thread that ran a parallel region (the
build's warm-up and KV-cache profiling passes ran one), so the service held an idle pool
beside the engine thread's; GNU OpenMP then counts more threads than CPUs and sleeps at
every barrier of the fused decode kernel instead of spinning, and a served decode step
took much longer than the same step offline. Here the service runs in this process (the
tiny random Llama, float32) with an ``EngineCore`` that records its threads.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tandem.contracts.role import Role
from tandem.engine import engine_core
from tandem.services.common import server
from tandem.services.decode.main import add_servicers as add_decode


def test_engine_is_built_in_the_thread_that_steps_it(tiny: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    built_in: list[int] = []
    polled_in: list[int] = []

    class RecordingEngineCore(engine_core.EngineCore):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            built_in.append(threading.get_ident())

        def has_unfinished_requests(self) -> bool:
            # The engine loop asks this first thing in its thread; then the service may stop
            # (asyncio's SIGTERM handler sets its stop event; it is installed before the build).
            if built_in and not polled_in:
                polled_in.append(threading.get_ident())
                os.kill(os.getpid(), signal.SIGTERM)
            return super().has_unfinished_requests()

    monkeypatch.setattr(engine_core, "EngineCore", RecordingEngineCore)
    rc = server.run(["--role", "both", "--model", tiny, "--dtype", "float32",
                     "--listen", "127.0.0.1:0", "--num-kv-blocks", "16",
                     "--shutdown-grace-s", "0"],
                    prog="tandem serve", role=None, servicers={Role.BOTH: add_decode})
    assert rc == 0
    assert len(built_in) == 1 and len(polled_in) == 1
    assert built_in[0] == polled_in[0], "engine built in one thread and stepped in another"
    assert built_in[0] != threading.get_ident()  # not on the event loop's thread either
