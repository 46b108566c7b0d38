"""Name -> factory registries whose entries may be ``"module:function"`` strings, imported
on first use, so that choosing one implementation never imports the others (the KV
connector's and the KV-events publisher's registries)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def resolve(registry: Mapping[str, Any], name: str, what: str) -> Any:
    """The factory registered as ``name``, importing its module when it is a string.

    Args:
        registry: name -> factory, or ``"module:function"`` naming one.
        name: the name asked for.
        what: the field named in the error (e.g. ``"kv_connector"``).

    Raises:
        ValueError: ``"{what} must be one of [...], got {name!r}"`` for an unknown name.
        ImportError: the factory's module failed to import (not swallowed).
    """
    target = registry.get(name)
    if target is None:
        raise ValueError(f"{what} must be one of {sorted(registry)}, got {name!r}")
    if isinstance(target, str):
        module_name, func_name = target.split(":")
        return getattr(importlib.import_module(module_name), func_name)
    return target
