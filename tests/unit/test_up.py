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


def test_engines_share_the_available_memory_for_kv_caches() -> None:
    """Bug (H9): every engine sized its KV cache from the memory free when it started (up
    to 4 GiB each); engines started together all saw the same free memory, so `tandem up`
    with 2+ engines could claim it several times over (out of memory on a small box)."""
    from tandem.up import StackConfig, kv_cache_args

    def budget(cfg: StackConfig, available: int) -> int:
        args = kv_cache_args(cfg, available_bytes=available)
        assert args[0] == "--kv-cache-memory"
        return int(args[1])

    gib = 1 << 30
    for cfg, num_engines in ((StackConfig(num_prefill=2, num_decode=2), 4),
                             (StackConfig(colocated=True, replicas=3), 3)):
        assert budget(cfg, 6 * gib) * num_engines <= 6 * gib // 2
    assert budget(StackConfig(), 64 * gib) == 4 * gib  # the engine's own cap
    # The user's own sizing (or a GPU) is left alone.
    for extra in (["--kv-cache-memory", "1000"], ["--num-kv-blocks=64"], ["--device=cuda"]):
        assert kv_cache_args(StackConfig(engine_args=extra), available_bytes=gib) == []
