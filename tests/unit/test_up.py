"""`tandem up` argument and environment checks that need no model and no engine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def test_port_in_use_fails_fast_naming_the_flag(tmp_path) -> None:
    """Bug (H9): with the router's port already taken, `tandem up` started redis, the KV
    store and every engine (a minute of model loading) before the router failed to bind,
    and then reported only "router exited with code 1". It must fail at once, naming the
    port and the flag, and leave nothing behind."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "tandem.cli", "up", "--colocated",
             "--model", str(tmp_path / "no-such-model"), "--port", str(port),
             "--grpc-port", "0", "--redis-url", "redis://127.0.0.1:1/0"],
            capture_output=True, text=True, timeout=120,
            env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode != 0
    assert f"--port {port}" in proc.stderr, proc.stderr
    assert "in use" in proc.stderr, proc.stderr
    assert not list(tmp_path.glob("tandem-up-*")), "temp dir left behind"
