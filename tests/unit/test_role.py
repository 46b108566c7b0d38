"""contracts/role.py: one Role enum whose values are the strings on the wire."""

from __future__ import annotations

import argparse
import json

import pytest

from tandem.contracts.role import ROLES, Role
from tandem.services.common.metrics import ServiceMetrics
from tandem.services.common.registry import instance_key
from tandem.services.common.server import build_engine_config, build_parser
from tandem.services.router.discovery import StaticDiscovery, _parse_entry


def test_values_format_and_serialise_as_the_plain_strings() -> None:
    assert [r.value for r in ROLES] == ["prefill", "decode", "both"]
    for role in Role:
        assert role == role.value and hash(role) == hash(role.value)
        assert str(role) == f"{role}" == format(role, "") == role.value
        assert json.dumps({"role": role}) == json.dumps({"role": role.value})
    assert [r.uses_store for r in ROLES] == [True, True, False]


def test_parse_names_the_field() -> None:
    assert Role.parse("both") is Role.BOTH
    with pytest.raises(ValueError, match=r"--role must be one of prefill, decode, both, got 'x'"):
        Role.parse("x", "--role")


def test_service_and_router_speak_the_same_values() -> None:
    """The registry key, the metric label and the router's view all hold the value string."""
    assert instance_key(Role.DECODE, "i1") == "tandem:instance:decode:i1"
    metrics = ServiceMetrics(Role.BOTH)
    metrics.num_requests_running.labels(role="both").set(1)
    text = "\n".join(str(m) for m in metrics.registry.collect())
    assert "role" in text and "Role." not in text
    info = _parse_entry("tandem:instance:prefill:x", {"role": "prefill", "address": "h:1"})
    assert info is not None and info.role is Role.PREFILL
    d = StaticDiscovery(both=["h:2"])
    assert [i.address for i in d.instances(Role.BOTH)] == ["h:2"]
    assert not d.instances(Role.PREFILL) and not d.instances("prefill")


def test_engine_config_rejects_an_unknown_role() -> None:
    ns = build_parser("tandem serve", None).parse_args(["--role", "both"])
    assert build_engine_config(ns, "both").kv_transfer.kv_connector is None
    with pytest.raises(ValueError, match="role must be one of"):
        build_engine_config(argparse.Namespace(**vars(ns)), "colocated")
    with pytest.raises(ValueError, match="--redis-url is required for role 'prefill'"):
        build_engine_config(ns, Role.PREFILL)


def test_deterministic_flag_of_every_engine_role_reaches_the_model_config() -> None:
    """``--deterministic`` (issue 20's reproducible greedy) on tandem serve, prefill and
    decode, ``LLM(deterministic=...)`` and ``tandem up --engine-arg``; refused on CUDA
    before anything loads, naming the field."""
    from tandem import LLM
    from tandem.engine.config import ModelConfig
    from tandem.up import build_parser as up_parser
    from tandem.up import config_from_args

    redis = ["--redis-url", "redis://127.0.0.1:1/0"]
    for role, argv in ((None, ["--role", "both"]), (Role.PREFILL, redis), (Role.DECODE, redis)):
        parser = build_parser("tandem", role)
        on = build_engine_config(parser.parse_args([*argv, "--deterministic"]), role or "both")
        off = build_engine_config(parser.parse_args(argv), role or "both")
        assert on.model.deterministic is True and off.model.deterministic is False
    cuda = build_parser("tandem serve", None).parse_args(
        ["--role", "both", "--deterministic", "--device", "cuda"])
    with pytest.raises(ValueError, match="deterministic is only implemented on the CPU"):
        build_engine_config(cuda, "both")
    with pytest.raises(ValueError, match="deterministic is only implemented on the CPU"):
        LLM(device="cuda:0", deterministic=True)
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        ModelConfig(deterministic="yes")  # type: ignore[arg-type]
    stack = config_from_args(up_parser().parse_args(["--engine-arg=--deterministic"]))
    assert stack.engine_args == ["--deterministic"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--block-size", "7"], "--block-size must be a power of two"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size must be"),
])
def test_a_bad_engine_flag_is_named_as_the_flag(argv: list[str], said: str, capsys) -> None:
    """The engine's configs name their fields; the service's command line says the flag."""
    from tandem.services.common.server import run

    assert run(argv, "tandem serve", Role.BOTH, {}) == 2
    err = capsys.readouterr().err
    assert f"tandem serve: error: {said}" in err, err


def test_flag_words_leave_other_messages_alone() -> None:
    from tandem.services.common.server import in_flag_words

    parser = build_parser("tandem serve", Role.BOTH)
    ns = parser.parse_args([])
    assert in_flag_words("deterministic: x", ns, parser) == "--deterministic: x"
    assert in_flag_words("the model folder has no config", ns, parser) == \
        "the model folder has no config"
    assert in_flag_words("max_num_seqsX must", ns, parser) == "max_num_seqsX must"
