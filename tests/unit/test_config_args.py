"""Flags generated from a config dataclass (``contracts/config_args.py``): one option per
flagged field with the field's type, default and choices, read back into the field's type."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from typing import Literal

import pytest

from tandem.contracts.config_args import (
    add_config_flags,
    config_from_args,
    config_kwargs,
    flag,
    option_of,
)
from tandem.engine.engine_args import flag_words


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Toy:
    """A config with one field of each kind a flag can take."""

    num_items: int = field(default=3, metadata=flag("items"))
    ratio_s: float | None = field(default=None, metadata=flag("seconds", metavar="S"))
    mode: Literal["a", "b"] = field(default="a", metadata=flag("mode", aliases=("-m",)))
    color: Color = field(default=Color.RED, metadata=flag("color"))
    sizes: tuple[int, ...] | None = field(default=None, metadata=flag("sizes", name="--size"))
    fast: bool = field(default=True, metadata=flag("fast"))
    eager: bool = field(default=False, metadata=flag("eager", bool_style="store_true"))
    publish: bool = field(default=True, metadata=flag("publish", bool_style="value"))
    name: str = field(default="x", metadata=flag("name", choices=("x", "y")))
    hidden: int = 7

    def __post_init__(self) -> None:
        if self.num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {self.num_items}")


def _parser(**kwargs: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    add_config_flags(p, Toy, **kwargs)  # type: ignore[arg-type]
    return p


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert config_from_args(Toy, _parser().parse_args([])) == Toy()


def test_each_kind_of_field_reads_back_in_its_type() -> None:
    ns = _parser().parse_args(
        [
            "--num-items",
            "5",
            "--ratio-s",
            "0.5",
            "-m",
            "b",
            "--color",
            "blue",
            "--size",
            "4",
            "2",
            "--no-fast",
            "--eager",
            "--publish",
            "off",
            "--name",
            "y",
        ]
    )
    assert config_from_args(Toy, ns) == Toy(
        num_items=5,
        ratio_s=0.5,
        mode="b",
        color=Color.BLUE,
        sizes=(4, 2),
        fast=False,
        eager=True,
        publish=False,
        name="y",
    )


def test_options_and_forms_in_help() -> None:
    text = _parser().format_help()
    for expected in (
        "--num-items NUM_ITEMS",
        "--ratio-s S",
        "--mode {a,b}, -m {a,b}",
        "--color {red,blue}",
        "--size SIZE [SIZE ...]",
        "--fast, --no-fast",
        "--eager",
        "--publish BOOL",
        "--name {x,y}",
    ):
        assert expected in text, expected
    assert "--hidden" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--mode", "c"],
        ["--color", "green"],
        ["--publish", "maybe"],
        ["--num-items", "many"],
        ["--name", "z"],
    ],
)
def test_a_value_outside_the_type_or_choices_is_refused(argv: list[str]) -> None:
    with pytest.raises(argparse.ArgumentError):
        _parser().parse_args(argv)


def test_validation_stays_the_dataclass_own() -> None:
    with pytest.raises(ValueError, match="num_items must be >= 1"):
        config_from_args(Toy, _parser().parse_args(["--num-items", "0"]))


def test_only_defaults_helps_and_overrides() -> None:
    p = _parser(
        only=["num_items", "sizes"],
        defaults={"sizes": (1,)},
        helps={"num_items": "items of this command"},
    )
    ns = p.parse_args([])
    assert not hasattr(ns, "mode")
    assert config_kwargs(Toy, ns) == {"num_items": 3, "sizes": (1,)}
    assert "items of this command" in p.format_help()
    assert config_from_args(Toy, ns, num_items=9, hidden=1) == Toy(
        num_items=9, sizes=(1,), hidden=1
    )


@pytest.mark.parametrize(
    "kwargs", [{"only": ["hidden"]}, {"defaults": {"nope": 1}}, {"helps": {"hidden": "h"}}]
)
def test_unknown_field_names_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="no flagged field of Toy"):
        _parser(**kwargs)


def test_a_field_type_without_a_flag_form_is_refused() -> None:
    @dataclass(frozen=True)
    class Nested:
        inner: Toy = field(default_factory=Toy, metadata=flag("a nested config"))

    with pytest.raises(TypeError, match="inner: no flag"):
        add_config_flags(argparse.ArgumentParser(), Nested)


def test_errors_about_a_field_name_its_flag() -> None:
    assert option_of([Toy], "sizes") == "--size"
    assert option_of([Toy], "hidden") is None
    assert flag_words("num_blocks_override must be >= 1, got 0") == (
        "--num-kv-blocks must be >= 1, got 0"
    )
    assert flag_words("policy must be 'fcfs' or 'priority'") == (
        "--scheduling-policy must be 'fcfs' or 'priority'"
    )
    assert flag_words("the model folder has no config") == "the model folder has no config"
