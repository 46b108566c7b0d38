"""A real ``redis-server`` on a port of the test's choosing, restartable on that port.

Its own module (not a conftest): with tests/unit and tests/integration in one run, the name
``conftest`` resolves to whichever conftest pytest imported first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tandem.launch import Part, redis_ok, start_part, wait_ready


class RedisServer:
    """A ``redis-server`` subprocess without persistence; restartable on the same port;
    with ``password``, clients must authenticate (``requirepass``; the URL carries it);
    with ``tls`` = (certificate, key, CA certificate) PEM files it serves TLS only on
    ``port`` and the URL is ``rediss://`` naming the CA (redis-py's ``ssl_ca_certs``);
    ``extra_args`` are more command-line directives (e.g. ``--rename-command``)."""

    def __init__(self, port: int, password: str | None = None,
                 tls: tuple[Path, Path, Path] | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.port = port
        self.password = password
        self.tls = tls
        self.extra_args = list(extra_args)
        auth = f":{password}@" if password else ""
        if tls is None:
            self.url = f"redis://{auth}127.0.0.1:{port}/0"
        else:
            self.url = f"rediss://{auth}127.0.0.1:{port}/0?ssl_ca_certs={tls[2]}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (make redis)")
        # Through tandem.launch (tandem.child): a pytest killed by a timeout runs no
        # teardown, and redis then dies with it instead of living on as an orphan (seen
        # after a killed CI run).
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            crt, key, ca = self.tls
            listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(crt),
                      "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                      "--tls-auth-clients", "no"]
        self.part = Part("redis", [exe, *listen, "--bind", "127.0.0.1",
                                   "--save", "", "--appendonly", "no",
                                   *(["--requirepass", self.password] if self.password else []),
                                   *self.extra_args],
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
