"""Driving an ``EngineCore`` step by step in tests."""

from __future__ import annotations

from tandem.engine.engine_core import EngineCore
from tandem.engine.request import Request


def run(core: EngineCore, *reqs: Request) -> dict[str, list]:
    """Add ``reqs``, step until nothing is unfinished; request id -> its
    ``EngineCoreOutput``s in order (also for requests added before the call)."""
    for r in reqs:
        core.add_request(r)
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    while core.has_unfinished_requests():
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs
