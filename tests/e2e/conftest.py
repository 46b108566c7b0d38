"""The e2e tests reuse the integration tests' shared fixtures (a real redis-server).

``tests/integration/conftest.py`` is only visible to tests under that folder; this shim
loads it under its own module name and re-exports its fixtures here.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
_spec = importlib.util.spec_from_file_location("tandem_tests_integration_conftest", _PATH)
assert _spec is not None and _spec.loader is not None, f"cannot load {_PATH}"
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)

redis_server = _shared.redis_server
redis_url = _shared.redis_url
