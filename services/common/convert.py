"""Checks of the engine services on protobuf fields."""

from __future__ import annotations


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    """Raise ``ValueError`` naming ``field`` unless every id is in ``[0, vocab_size)``."""
    for i, tok in enumerate(token_ids):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"{field}[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
