"""services/router/tenants.py and ``--api-keys``: the key file read once into frozen
tenants; each mistake a start-up error naming the entry and field (exit 2), never the
key itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.services.router.config import RouterConfig
from tandem.services.router.main import build_parser, main
from tandem.services.router.tenants import Tenant, key_of, load_key_table, parse_key_table

SECRET = "sk-very-secret-key"


def _cfg(*flags: str, environ: dict[str, str] | None = None) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(["--colocated", "h:1", *flags]),
                                  environ or {})


def test_yaml_file_into_frozen_tenants(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("sk-a1: {tenant: alpha, requests_per_minute: 2, tokens_per_minute: 500}\n"
                    "sk-a2: {tenant: alpha, requests_per_minute: 2, tokens_per_minute: 500}\n"
                    "sk-b:\n  tenant: beta\n")
    table = load_key_table(str(path))
    alpha = Tenant("alpha", 2, 500)
    assert table.tenant_of("sk-a1") == alpha and table.tenant_of("sk-a2") is table.tenant_of(
        "sk-a1")
    assert table.tenant_of("sk-b") == Tenant("beta") and not Tenant("beta").is_limited
    assert table.tenant_of("sk-c") is None and table.tenant_of(None) is None
    assert table.tenant_of("") is None
    assert [t.name for t in table.tenants] == ["alpha", "beta"]
    with pytest.raises(TypeError):
        table.by_key["sk-c"] = alpha  # type: ignore[index]
    with pytest.raises(AttributeError):
        alpha.requests_per_minute = 3  # type: ignore[misc]


def test_json_file_through_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({SECRET: {"tenant": "alpha", "tokens_per_minute": 100}}))
    cfg = _cfg("--api-keys", str(path), "--rate-limit-url", "redis://r:1")
    assert cfg.api_keys is not None and cfg.api_keys.tenant_of(SECRET) == Tenant("alpha", None,
                                                                                 100)
    assert cfg.api_key is None and cfg.rate_limit_url == "redis://r:1"
    # the limits are counted in the discovery Redis unless told otherwise
    redis_cfg = RouterConfig.from_args(build_parser().parse_args(
        ["--redis-url", "redis://d:1", "--api-keys", str(path)]), {})
    assert redis_cfg.rate_limit_url == "redis://d:1"
    assert _cfg("--api-keys", str(path)).rate_limit_url is None


@pytest.mark.parametrize(("data", "message"), [
    ([SECRET], "--api-keys: must map API keys to {tenant: NAME, ...}, got list"),
    ({}, "--api-keys: holds no API key"),
    ({SECRET: "alpha"}, "entry 1: must be {tenant: NAME, requests_per_minute: N, "
                        "tokens_per_minute: N}, got str"),
    ({SECRET: {"tenant": "alpha", "rpm": 3}}, "entry 1: unknown field 'rpm'"),
    ({SECRET: {"requests_per_minute": 3}}, "entry 1: tenant: required"),
    ({SECRET: {"tenant": "al pha"}}, "entry 1 (tenant 'al pha'): tenant: must be 1 to 64"),
    ({"sk-x": {"tenant": "x"}, SECRET: {"tenant": "alpha", "requests_per_minute": 0}},
     "entry 2 (tenant 'alpha'): requests_per_minute: must be an integer >= 1, got 0"),
    ({SECRET: {"tenant": "alpha", "tokens_per_minute": 1.5}},
     "entry 1 (tenant 'alpha'): tokens_per_minute: must be an integer >= 1, got 1.5"),
    ({SECRET: {"tenant": "alpha", "tokens_per_minute": True}},
     "tokens_per_minute: must be an integer >= 1, got True"),
    ({SECRET: {"tenant": "alpha", "requests_per_minute": 5},
      "sk-2": {"tenant": "alpha", "requests_per_minute": 6}},
     "entry 2 (tenant 'alpha'): its limits differ from another key of tenant 'alpha'"),
    ({" sk-pad": {"tenant": "alpha"}}, "entry 1: the API key must be a non-empty string"),
    ({"": {"tenant": "alpha"}}, "entry 1: the API key must be a non-empty string"),
])
def test_bad_entries_name_the_entry_and_field_not_the_key(data: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_key_table(data)
    assert message in str(info.value)
    assert SECRET not in str(info.value)


def test_unreadable_or_unparsable_file_names_the_flag_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "none.yaml"
    with pytest.raises(ValueError, match=f"--api-keys {missing}: cannot read it"):
        load_key_table(str(missing))
    bad = tmp_path / "bad.yaml"
    bad.write_text("sk-a: {tenant: alpha\n")
    with pytest.raises(ValueError, match=f"--api-keys {bad}: not valid YAML or JSON"):
        load_key_table(str(bad))


def test_api_key_and_api_keys_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("sk-a: {tenant: alpha}\n")
    for flags, environ in (((("--api-key", "k"),), {}), ((), {"TANDEM_API_KEY": "k"})):
        with pytest.raises(ValueError, match="--api-keys: give it or --api-key"):
            _cfg("--api-keys", str(path), *(f for pair in flags for f in pair),
                 environ=environ)


def test_main_exits_2_on_a_bad_key_file(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f"{SECRET}: {{tenant: alpha, tokens_per_minute: -5}}\n")
    assert main(["--colocated", "h:1", "--api-keys", str(path)]) == 2
    err = capsys.readouterr().err
    assert "entry 1 (tenant 'alpha'): tokens_per_minute: must be an integer >= 1" in err
    assert SECRET not in err


def test_key_of_reads_bearer_then_x_api_key() -> None:
    assert key_of({"authorization": "Bearer sk-1"}) == "sk-1"
    assert key_of({"x-api-key": "sk-2"}) == "sk-2"
    assert key_of({"authorization": "Basic abc", "x-api-key": "sk-2"}) == "sk-2"
    assert key_of({}) is None and key_of({"x-api-key": ""}) is None
