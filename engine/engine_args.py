"""The engine's flags, generated from its config dataclasses (vLLM's ``EngineArgs``).

Every engine command (``tandem prefill|decode|serve``, ``tandem bench throughput``) adds
the same options with :func:`add_engine_flags` and builds its ``EngineConfig`` with
:func:`engine_config_from_args`; each option's name, type, default, choices and help are
those of a field of ``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``,
``ParallelConfig`` or ``CompilationConfig`` (``contracts/config_args.py``), plus
``--speculative-config`` (vLLM's JSON form of ``SpeculativeConfig``). To add an engine
flag: add the field to its config with ``metadata=flag("help")``.

Imports no torch: ``tandem serve --help`` stays cheap.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

from tandem.contracts.config_args import (
    AddsArguments,
    add_config_flags,
    config_from_args,
    flagged_fields,
    option_of,
)
from tandem.engine.config import (
    CacheConfig,
    CompilationConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from tandem.engine.speculative_config import SpeculativeConfig

#: The config classes whose flagged fields are engine flags, in ``--help`` order.
ENGINE_CONFIGS: tuple[type, ...] = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    CompilationConfig,
)

SPECULATIVE_HELP = (
    'speculative decoding, vLLM\'s JSON: {"method": "ngram"|"draft_model", '
    '"num_speculative_tokens": k, "prompt_lookup_min": .., "prompt_lookup_max": .., '
    '"model": PATH} (default: off)'
)


def engine_field_names() -> frozenset[str]:
    """The names of every config field that is an engine flag."""
    return frozenset(f.name for cls in ENGINE_CONFIGS for f, _ in flagged_fields(cls))


def add_engine_flags(
    parser: AddsArguments,
    *,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
    speculative: bool = True,
) -> None:
    """Add the engine's flags to ``parser``.

    Args:
        only: config field names to add (``None``: all of them).
        defaults / helps: field name -> this command's own default / help text.
        speculative: also add ``--speculative-config JSON``.

    Raises:
        ValueError: a name in ``only``, ``defaults`` or ``helps`` that is no engine flag.
    """
    known = engine_field_names()
    wanted = set(known if only is None else only)
    for what, given in (("only", wanted), ("defaults", defaults or {}), ("helps", helps or {})):
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"{what}: {unknown[0]!r} is no engine flag")
    for cls in ENGINE_CONFIGS:
        names = {f.name for f, _ in flagged_fields(cls)}
        add_config_flags(
            parser,
            cls,
            only=names & wanted,
            defaults={k: v for k, v in (defaults or {}).items() if k in names},
            helps={k: v for k, v in (helps or {}).items() if k in names},
        )
    if speculative:
        parser.add_argument(
            "--speculative-config", default=None, metavar="JSON", help=SPECULATIVE_HELP
        )


def engine_config_from_args(
    ns: argparse.Namespace, kv_transfer: KVTransferConfig | None = None
) -> EngineConfig:
    """The frozen ``EngineConfig`` of the parsed engine flags (those a parser built with
    ``only`` lacks keep the configs' defaults).

    Raises:
        ValueError: a bad value, naming the config field (:func:`flag_words` turns it
            into the flag's name); a ``--speculative-config`` that does not parse.
    """
    spec = getattr(ns, "speculative_config", None)
    return EngineConfig(
        model=config_from_args(ModelConfig, ns),
        cache=config_from_args(CacheConfig, ns),
        scheduler=config_from_args(SchedulerConfig, ns),
        parallel=config_from_args(ParallelConfig, ns),
        compilation=config_from_args(CompilationConfig, ns),
        kv_transfer=kv_transfer or KVTransferConfig(),
        speculative=None if spec is None else SpeculativeConfig.from_json(spec),
    )


def flag_words(message: str, classes: Iterable[type] = ENGINE_CONFIGS) -> str:
    """``message`` of a config error that starts with a flagged field's name
    (``num_blocks_override must be >= 1``) with that field written as its flag
    (``--num-kv-blocks must be >= 1``); other messages unchanged."""
    head = message.split(" ", 1)[0].rstrip(":")
    option = option_of(classes, head)
    return message if option is None else option + message[len(head) :]
