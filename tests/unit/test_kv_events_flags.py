"""``--kv-events`` of the engine commands: off by default, on with ``--redis-url`` (the
topic is the instance id), refused by name without a Redis."""

from __future__ import annotations

import pytest

from tandem.contracts.role import Role
from tandem.services.common.server import build_engine_config, build_parser


def config_of(role: Role | None, *flags: str):
    prog_role = Role.BOTH if role is None else role
    return build_engine_config(build_parser("tandem x", role).parse_args(list(flags)), prog_role)


def test_off_by_default() -> None:
    cfg = config_of(Role.PREFILL, "--redis-url", "redis://r:6380/0")
    assert not cfg.kv_events.enable_kv_cache_events


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_on_publishes_to_the_registry_redis_under_the_instance_id(role: Role) -> None:
    cfg = config_of(role, "--redis-url", "redis://r:6380/0", "--instance-id", "p-1", "--kv-events")
    assert cfg.kv_events.enable_kv_cache_events
    assert (cfg.kv_events.endpoint, cfg.kv_events.topic) == ("redis://r:6380/0", "p-1")
    cfg = config_of(role, "--redis-url", "redis://r/0", "--kv-events", "--no-kv-events")
    assert not cfg.kv_events.enable_kv_cache_events  # the last one wins (tandem up's override)


def test_colocated_without_redis_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--kv-events requires --redis-url"):
        config_of(None, "--role", "both", "--kv-events", "--instance-id", "c-1")
