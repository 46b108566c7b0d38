"""A real ``redis-server`` on a port of the test's choosing, restartable on that port.

Its own module (not a conftest): with tests/unit and tests/integration in one run, the name
``conftest`` resolves to whichever conftest pytest imported first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tandem.launch import Part, redis_ok, start_part, wait_ready


class RedisServer:
    """A ``redis-server`` subprocess without persistence; restartable on the same port;
    with ``password``, clients must authenticate (``requirepass``; the URL carries it)."""

    def __init__(self, port: int, password: str | None = None) -> None:
        self.port = port
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (make redis)")
        # Through tandem.launch (tandem.child): a pytest killed by a timeout runs no
        # teardown, and redis then dies with it instead of living on as an orphan (seen
        # after a killed CI run).
        self.part = Part("redis", [exe, "--port", str(self.port), "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no",
                                   *(["--requirepass", self.password] if self.password else [])],
                         lambda: redis_ok(self.url, timeout_s=1))
        self.proc = start_part(self.part, log_path=Path(os.devnull))
        wait_ready([self.part], timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same port: every key is lost."""
        self.stop()
        self.start()
