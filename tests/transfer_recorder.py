"""A ``TransferListener`` for the KV connector tests that keeps every outcome (beside
``memory_connector.py``; ``tests/`` is on pytest's pythonpath)."""

from __future__ import annotations

import threading

from tandem.engine.kv_connector import LoadResult, SaveResult


class Recorder:
    """A ``TransferListener`` that keeps every outcome."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.saves: dict[str, SaveResult] = {}
        self.loads: dict[str, LoadResult] = {}

    def on_save_done(self, request_id: str, result: SaveResult) -> None:
        with self.lock:
            self.saves[request_id] = result

    def on_load_done(self, request_id: str, result: LoadResult) -> None:
        with self.lock:
            self.loads[request_id] = result

    def on_lookup_done(self, request_id: str) -> None:
        pass
