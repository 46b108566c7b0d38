"""The role an engine service plays, as flags, the instance registry and metric labels spell it."""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """What an engine instance does for a request.

    A ``str`` enum: each member equals its value (``Role.BOTH == "both"``), formats and
    serialises as it (registry JSON, the ``role`` metric label, ``--role`` flags), so the
    values on the wire are those of plain strings.
    """

    PREFILL = "prefill"
    """computes a prompt's KV cache, publishes it to the KV store, samples the first token"""
    DECODE = "decode"
    """pulls a prefilled prompt's KV blocks from the store and streams the output tokens"""
    BOTH = "both"
    """colocated: prefill and decode in one engine, no KV store"""

    # NOTE: Python < 3.12 formats a mixed-in str enum as "Role.PREFILL" in str(); the value
    # is what every log line, label and key should read.
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)

    @property
    def uses_store(self) -> bool:
        """Whether this role hands KV blocks over the store (prefill, decode)."""
        return self is not Role.BOTH

    @classmethod
    def parse(cls, value: str, field: str = "role") -> Role:
        """The member whose value is ``value``.

        Raises:
            ValueError: naming ``field`` and the valid values when ``value`` is none of them.
        """
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(r.value for r in cls)
            raise ValueError(f"{field} must be one of {valid}, got {value!r}") from None


#: every role, in flag order
ROLES: tuple[Role, ...] = tuple(Role)
