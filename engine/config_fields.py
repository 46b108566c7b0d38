"""Checks shared by the frozen configuration dataclasses (``engine/config.py``,
``engine/speculative_config.py``)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def known_fields(cls: type, name: str, value: object, kind: str) -> dict[str, Any]:
    """``value`` as a dict whose keys are all fields of the dataclass ``cls``.

    Raises:
        ValueError: naming ``name``: ``value`` is not a dict (``kind`` says what it
            must be), or has a key that is not a field (the known ones listed).
    """
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be {kind}, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"{name}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    return value
