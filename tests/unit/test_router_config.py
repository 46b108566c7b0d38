"""services/router/config.py: the router's flags and environment, read once and validated."""

from __future__ import annotations

import pytest

from tandem.services.router.config import RouterConfig
from tandem.services.router.main import build_parser, main
from tandem.services.router.routing import RoutingPolicy


def _cfg(*flags: str, environ: dict[str, str] | None = None) -> RouterConfig:
    return RouterConfig.from_args(build_parser().parse_args(list(flags)), environ or {})


def test_flags_and_environment_into_one_frozen_value() -> None:
    cfg = _cfg("--prefill", "a:1, b:2,", "--decode", "c:3", "--routing-policy", "round_robin",
               environ={"TANDEM_API_KEY": "env-key"})
    assert cfg.prefill == ("a:1", "b:2") and cfg.decode == ("c:3",) and not cfg.colocated
    assert cfg.routing_policy is RoutingPolicy.ROUND_ROBIN
    assert cfg.api_key == "env-key"
    assert _cfg("--colocated", "h:1", "--api-key", "flag-key",
                environ={"TANDEM_API_KEY": "env-key"}).api_key == "flag-key"
    assert _cfg("--colocated", "h:1", environ={"TANDEM_API_KEY": ""}).api_key is None
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]
    assert cfg.max_request_body_bytes is None  # derived from the context length
    assert _cfg("--colocated", "h:1", "--max-request-body-bytes", "1048576"
                ).max_request_body_bytes == 1 << 20


@pytest.mark.parametrize(("flags", "message"), [
    (("--redis-url", "redis://h:1", "--prefill", "a:1"), "--redis-url: .*not both"),
    ((), "--redis-url: give it or --prefill"),
    (("--colocated", "h:1", "--port", "70000"), "--port must be in 0..65535"),
    (("--colocated", "h:1", "--max-attempts", "0"), "--max-attempts must be >= 1"),
    (("--colocated", "h:1", "--max-migrations", "-1"), "--max-migrations must be >= 0"),
    (("--colocated", "h:1", "--max-model-len", "0"), "--max-model-len must be >= 1"),
    (("--colocated", "h:1", "--max-request-body-bytes", "0"),
     "--max-request-body-bytes must be >= 1"),
])
def test_bad_flags_are_value_errors_naming_the_flag(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(*flags)


def test_main_rejects_bad_flags_before_loading_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--redis-url", "redis://h:1", "--decode", "a:1"]) == 2
    assert "tandem router: error: --redis-url" in capsys.readouterr().err


def test_event_loop_and_http_implementation_are_checked() -> None:
    cfg = _cfg("--colocated", "h:1", "--loop", "asyncio", "--http", "h11")
    assert (cfg.loop, cfg.http) == ("asyncio", "h11")
    assert (_cfg("--colocated", "h:1").loop, _cfg("--colocated", "h:1").http) == ("auto", "auto")
    with pytest.raises(ValueError, match="--loop must be"):
        RouterConfig(colocated=("h:1",), loop="trio")
    with pytest.raises(ValueError, match="--http must be"):
        RouterConfig(colocated=("h:1",), http="h2")
