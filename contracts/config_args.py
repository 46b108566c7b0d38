"""Command-line flags generated from frozen config dataclasses (vLLM's ``EngineArgs`` idea).

A config field that is also a flag carries a :class:`Flag` in its ``dataclasses.field``
metadata (made by :func:`flag`): its help and, where the flag's spelling is not the field's
name, that spelling. The field's type and default stay the dataclass's own, so each default
and each help text is written once:

    max_num_seqs: int = field(default=128, metadata=flag("most requests running at once"))

:func:`add_config_flags` adds one option per such field to an ``argparse`` parser (name
``--max-num-seqs`` from the field name unless ``Flag.name`` says otherwise, ``type`` from
the annotation, ``choices`` from a ``Literal`` or an ``Enum``, ``nargs="+"`` for
``tuple[X, ...]``, ``argparse.BooleanOptionalAction`` for a ``bool``) and
:func:`config_kwargs` reads them back from the parsed namespace as the fields' values.

Shared by every command (engine services, router, benchmarks), so it imports only the
standard library: the router's import closure must stay free of torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

#: ``dataclasses.field(metadata=...)`` key under which a field's :class:`Flag` is kept.
FLAG_KEY = "tandem.flag"

BoolStyle = Literal["optional", "store_true", "value"]
_C = typing.TypeVar("_C")

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_bool_flag(text: str) -> bool:
    """``true|false`` (also ``1|0``, ``yes|no``, ``on|off``) of a boolean flag that takes a
    value (``Flag.bool_style="value"``: ``--kv-publish-output=false``).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line.

    Attributes:
        help: the option's help text.
        name: the long option (``"--kv-cache-memory"``); ``None``: ``--`` and the field's
            name with ``-`` for ``_``.
        aliases: further option strings (``("-tp",)``).
        metavar: argparse's metavar (``"S"``, ``"PATH"``), ``None`` for argparse's own.
        bool_style: for a ``bool`` field: ``"optional"`` ``--x`` / ``--no-x``
            (``argparse.BooleanOptionalAction``); ``"store_true"`` ``--x`` alone (a field
            that defaults to ``False`` and is only ever switched on); ``"value"`` ``--x
            true|false`` (:func:`parse_bool_flag`).
        choices: the accepted values where the annotation does not say them (a ``str``
            field checked against a registry's names); ``None``: from a ``Literal`` or an
            ``Enum`` annotation, else any value.
    """

    help: str
    name: str | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    bool_style: BoolStyle = "optional"
    choices: tuple[Any, ...] | None = None

    def option(self, field_name: str) -> str:
        """The long option of the field ``field_name``."""
        return self.name or "--" + field_name.replace("_", "-")

    def dest(self, field_name: str) -> str:
        """The namespace attribute argparse stores the option under (its long option's
        name with ``_`` for ``-``, argparse's own rule)."""
        return self.option(field_name)[2:].replace("-", "_")


def flag(
    help: str,  # noqa: A002 - argparse's name
    *,
    name: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    bool_style: BoolStyle = "optional",
    choices: Iterable[Any] | None = None,
) -> dict[str, Flag]:
    """The ``metadata`` of a config field that is a flag: ``field(default=..,
    metadata=flag("help"))``. Arguments as :class:`Flag`'s attributes."""
    return {
        FLAG_KEY: Flag(
            help,
            name,
            tuple(aliases),
            metavar,
            bool_style,
            None if choices is None else tuple(choices),
        )
    }


def flagged_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The fields of the dataclass ``cls`` that are flags, in declaration order."""
    return [(f, f.metadata[FLAG_KEY]) for f in dataclasses.fields(cls) if FLAG_KEY in f.metadata]


def _strip_optional(tp: Any) -> Any:
    """``X`` of ``X | None`` (``Optional[X]``); other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _option_kwargs(f: dataclasses.Field[Any], spec: Flag, tp: Any) -> dict[str, Any]:
    """argparse's ``add_argument`` keywords of one field (``tp``: its resolved type)."""
    default = _default(f)
    kw: dict[str, Any] = {"help": spec.help, "default": default, "dest": spec.dest(f.name)}
    if spec.metavar is not None:
        kw["metavar"] = spec.metavar
    base = _strip_optional(tp)
    if base is bool:
        if spec.bool_style == "value":
            kw.setdefault("metavar", "BOOL")
            return {**kw, "type": parse_bool_flag}
        if spec.bool_style == "store_true":
            assert default is False, f"{f.name}: a store_true flag must default to False"
            kw.pop("metavar", None)
            return {**kw, "action": "store_true"}
        kw.pop("metavar", None)
        return {**kw, "action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        kw.update(nargs="+", type=item)
        if default is not None:
            kw["default"] = list(default)
        return kw
    if typing.get_origin(base) is Literal:
        values = typing.get_args(base)
        kw.update(type=type(values[0]), choices=list(values))
    elif isinstance(base, type) and issubclass(base, enum.Enum):
        kw.update(choices=[m.value for m in base])
        if isinstance(default, enum.Enum):
            kw["default"] = default.value
    elif base in (int, float, str):
        kw["type"] = base
    else:
        raise TypeError(f"{f.name}: no flag for a field of type {tp!r}")
    if spec.choices is not None:
        kw["choices"] = list(spec.choices)
    return kw


class AddsArguments(typing.Protocol):
    """What options are added to: an ``argparse.ArgumentParser`` or one of its argument
    groups (``parser.add_argument_group(...)``)."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


def add_config_flags(
    parser: AddsArguments,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add one option per flagged field of the dataclass ``cls`` to ``parser``.

    Args:
        only: the field names to add (``None``: every flagged field).
        exclude: field names to leave out.
        defaults: field name -> a default other than the dataclass's (a command whose
            own default differs, e.g. a benchmark's); the value in the field's type.
        helps: field name -> a help text other than the field's (what the flag means
            for this command, e.g. "tandem runs only: ...").

    Raises:
        TypeError: a flagged field whose type has no flag form (a nested config, a
            mapping): give it an option of its own.
        ValueError: a name in ``only``, ``defaults`` or ``helps`` that is no flagged field.
    """
    fields = flagged_fields(cls)
    names = {f.name for f, _ in fields}
    wanted = set(names if only is None else only) - set(exclude)
    for what, given in (("only", only or ()), ("defaults", defaults or {}), ("helps", helps or {})):
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"{what}: {unknown[0]!r} is no flagged field of {cls.__name__}")
    hints = typing.get_type_hints(cls)
    for f, spec in fields:
        if f.name not in wanted:
            continue
        kw = _option_kwargs(f, spec, hints[f.name])
        if defaults and f.name in defaults:
            value = defaults[f.name]
            kw["default"] = list(value) if isinstance(value, tuple) else value
        if helps and f.name in helps:
            kw["help"] = helps[f.name]
        parser.add_argument(spec.option(f.name), *spec.aliases, **kw)


def config_kwargs(
    cls: type, ns: argparse.Namespace, *, exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """The values of ``cls``'s flagged fields in the parsed namespace ``ns``, in the
    fields' types (a tuple for ``tuple[X, ...]``, the member for an ``Enum``): keywords of
    ``cls(...)``. Fields whose option ``ns`` lacks (a parser built with ``only``) or that
    are in ``exclude`` are left out, so the dataclass's default applies."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    skip = set(exclude)
    for f, spec in flagged_fields(cls):
        dest = spec.dest(f.name)
        if f.name in skip or not hasattr(ns, dest):
            continue
        value = getattr(ns, dest)
        base = _strip_optional(hints[f.name])
        if value is not None and typing.get_origin(base) is tuple:
            value = tuple(value)
        elif value is not None and isinstance(base, type) and issubclass(base, enum.Enum):
            value = base(value)
        out[f.name] = value
    return out


def config_from_args(cls: type[_C], ns: argparse.Namespace, **overrides: Any) -> _C:
    """``cls(**config_kwargs(cls, ns), **overrides)``: the frozen config of the flags, with
    the fields that are not flags (or are read differently) given in ``overrides``.

    Raises:
        ValueError: as ``cls`` does, naming the field.
    """
    kwargs = config_kwargs(cls, ns, exclude=overrides)
    return cls(**kwargs, **overrides)


def option_of(classes: Iterable[type], field_name: str) -> str | None:
    """The long option of the flagged field ``field_name`` of the first of ``classes``
    that has one, ``None`` if none has: to name the flag in an error about the field."""
    for cls in classes:
        for f, spec in flagged_fields(cls):
            if f.name == field_name:
                return spec.option(f.name)
    return None
