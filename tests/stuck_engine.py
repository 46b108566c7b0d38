"""A stand-in for ``EngineCore`` with just what ``EngineLoop`` calls: its step blocks
until the test releases it (a step of a real model cannot be made long on demand), and
it records the KV prefetches it is asked to start and to drop."""

from __future__ import annotations

import threading
from types import SimpleNamespace


class StuckStepEngine:
    """``release`` starts set when ``blocking`` is False (steps return at once)."""

    def __init__(self, blocking: bool = True) -> None:
        self.in_step = threading.Event()
        self.release = threading.Event()
        if not blocking:
            self.release.set()
        self.num_steps = 0
        self.num_batches_in_flight = 0
        self.prefetched: list[object] = []
        self.dropped: list[object] = []
        self._pending: list[str] = []

    def prefetch_kv(self, request: SimpleNamespace) -> None:
        self.prefetched.append(request)

    def drop_prefetch_kv(self, request: SimpleNamespace) -> None:
        self.dropped.append(request)

    def add_request(self, request: SimpleNamespace) -> None:
        if getattr(request, "bad", False):
            raise ValueError("max_tokens: must be >= 1")
        self._pending.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending)

    def step(self) -> list:
        self.in_step.set()
        self.release.wait()
        self._pending.clear()
        self.num_steps += 1
        return []

    def abort_requests(self, ids: list[str]) -> None:
        self._pending = [r for r in self._pending if r not in ids]

    def get_stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=len(self._pending), num_waiting=0,
                               kv_cache_usage=0.0, num_free_blocks=8, num_total_blocks=8)
