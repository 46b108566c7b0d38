"""Errors of the engine that its callers (the services) tell apart; torch-free, so the
router may map them without importing the engine."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The executor lost a worker (it died, or failed inside a step that every rank
    takes part in): no later step can run. The engine's callers fail every in-flight
    request with it and the service exits (its health turns NOT_SERVING first)."""
