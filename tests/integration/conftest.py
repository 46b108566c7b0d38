"""Shared fixtures of the integration tests: a real redis-server on a free port, and the
services tests' tiny model, KV store node and prefill / decode services.

``redis_url`` (session scoped) is used by the KV store, services and router tests. The
services fixtures are module scoped: each module gets its own processes, started with the
module's ``ENGINE_ARGS`` (extra `tandem serve` flags).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ports import free_port
from redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's redis-server (tests that restart it must leave it running)."""
    server = RedisServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    """URL of a real Redis started for this test session, e.g. ``redis://127.0.0.1:P/0``."""
    return redis_server.url


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Folder of the session's tiny random Llama (services_harness.tiny_model_dir)."""
    from services_harness import tiny_model_dir

    return str(tiny_model_dir(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def store(redis_url: str, tmp_path_factory: pytest.TempPathFactory):
    """A `tandem kvstore` node (services_harness.KVStoreNode) on ``redis_url``."""
    from services_harness import KVStoreNode

    node = KVStoreNode(redis_url, tmp_path_factory.mktemp("store"))
    yield node
    node.stop()


# The services fixtures import services_harness when they run: the e2e conftest loads this
# file on its own, where tests/integration is not on sys.path yet.


def _engine_service(role: str, request: pytest.FixtureRequest, tiny: str, redis_url: str,
                    tmp_path_factory: pytest.TempPathFactory):
    """Body of the ``prefill`` / ``decode`` fixtures (yields a services_harness.EngineService):
    the service with the requesting module's ``ENGINE_ARGS``; it must exit 0 on the SIGTERM
    of teardown."""
    from services_harness import EngineService

    args = request.module.ENGINE_ARGS
    svc = EngineService(role, tiny, tmp_path_factory.mktemp(role), redis_url, args)
    yield svc
    assert svc.stop() == 0, f"{role} did not exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def prefill(request, tiny, redis_url, store, tmp_path_factory):
    """A `tandem serve --role prefill`, ``store`` running (services_harness.EngineService)."""
    yield from _engine_service("prefill", request, tiny, redis_url, tmp_path_factory)


@pytest.fixture(scope="module")
def decode(request, tiny, redis_url, store, tmp_path_factory):
    """A `tandem serve --role decode`, ``store`` running (services_harness.EngineService)."""
    yield from _engine_service("decode", request, tiny, redis_url, tmp_path_factory)
