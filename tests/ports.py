"""The tests' one way to pick a TCP port (beside ``waiting.py``; ``tests/`` is on pythonpath)."""

from __future__ import annotations

from tandem.launch import free_port

__all__ = ["free_port"]
