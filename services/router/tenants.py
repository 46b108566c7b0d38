"""API keys and the tenants they belong to (``tandem router --api-keys FILE``).

The file (YAML or JSON; JSON is YAML) maps each API key to its tenant and the tenant's
optional limits::

    sk-alpha-1: {tenant: alpha, requests_per_minute: 60, tokens_per_minute: 100000}
    sk-alpha-2: {tenant: alpha, requests_per_minute: 60, tokens_per_minute: 100000}
    sk-beta:    {tenant: beta}

Limits belong to the tenant, so every key of one tenant gives the same ones (or none).
The file is read once, at start-up, into a frozen :class:`KeyTable`; what is wrong with it
is a ``ValueError`` naming the entry and the field. An entry is named by its position and
tenant, never by the key itself, so that a secret does not reach the logs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

#: Tenant names: they become Redis keys and Prometheus label values.
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELDS = frozenset({"tenant", "requests_per_minute", "tokens_per_minute"})


@dataclass(frozen=True)
class Tenant:
    """One tenant: a name and its limits over any one-minute window.

    Attributes:
        name: the tenant's name (1 to 64 of ``A-Z a-z 0-9 _ . -``, starting with a
            letter or digit); the ``tenant`` label of its metrics.
        requests_per_minute: generation requests admitted per minute, ``None``: no limit.
        tokens_per_minute: tokens admitted per minute (each request's prompt tokens plus
            the output tokens it may make, ``max_tokens`` times ``n``, corrected to its
            actual prompt + output tokens when it ends), ``None``: no limit.

    Raises:
        ValueError: naming the field, for a bad name or a limit below 1.
    """

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TENANT_NAME.fullmatch(self.name):
            raise ValueError(f"tenant: must be 1 to 64 of A-Z a-z 0-9 _ . - (starting with a "
                             f"letter or digit), got {self.name!r}")
        for field in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{field}: must be an integer >= 1, got {value!r}")

    @property
    def is_limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class KeyTable:
    """Which tenant each API key belongs to (read-only).

    Attributes:
        by_key: API key -> its tenant.
    """

    by_key: Mapping[str, Tenant]

    def tenant_of(self, key: str | None) -> Tenant | None:
        """The tenant of ``key``; ``None`` for a missing or unknown key."""
        return self.by_key.get(key) if key else None

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """Each tenant once, in the file's order."""
        return tuple(dict.fromkeys(self.by_key.values()))


def parse_key_table(data: Any, source: str = "--api-keys") -> KeyTable:
    """The ``KeyTable`` of a parsed ``--api-keys`` document (a mapping; see the module).

    Raises:
        ValueError: naming ``source``, the entry (its position and tenant) and the field:
            not a mapping, no keys, an empty key, an unknown field, a bad tenant name or
            limit, or keys of one tenant that give different limits.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: must map API keys to {{tenant: NAME, ...}}, got "
                         f"{type(data).__name__}")
    if not data:
        raise ValueError(f"{source}: holds no API key")
    by_key: dict[str, Tenant] = {}
    by_name: dict[str, Tenant] = {}
    for index, (key, entry) in enumerate(data.items()):
        where = f"{source}: entry {index + 1}"
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ValueError(f"{where}: the API key must be a non-empty string without "
                             "surrounding whitespace")
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: must be {{tenant: NAME, requests_per_minute: N, "
                             f"tokens_per_minute: N}}, got {type(entry).__name__}")
        unknown = sorted(str(f) for f in entry if f not in _FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: tenant, "
                             "requests_per_minute, tokens_per_minute)")
        if "tenant" not in entry:
            raise ValueError(f"{where}: tenant: required")
        where = f"{where} (tenant {entry['tenant']!r})"
        try:
            tenant = Tenant(entry["tenant"], entry.get("requests_per_minute"),
                            entry.get("tokens_per_minute"))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        seen = by_name.setdefault(tenant.name, tenant)
        if seen != tenant:
            raise ValueError(f"{where}: its limits differ from another key of tenant "
                             f"{tenant.name!r}: every key of a tenant gives the same limits")
        by_key[key] = seen
    return KeyTable(MappingProxyType(by_key))


def load_key_table(path: str) -> KeyTable:
    """Read an ``--api-keys`` file (YAML or JSON) into a ``KeyTable``.

    Raises:
        ValueError: naming ``--api-keys`` and the path for a file that cannot be read or
            parsed, else as :func:`parse_key_table`.
    """
    source = f"--api-keys {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source}: cannot read it: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML or JSON: {exc}") from None
    return parse_key_table(data, source)


def key_of(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: ``Authorization: Bearer KEY`` (OpenAI's clients)
    or ``x-api-key: KEY`` (Anthropic's); ``None`` when it carries neither."""
    auth = headers.get("authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):]
    return headers.get("x-api-key") or None
