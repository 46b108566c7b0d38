"""Real KV store nodes in subprocesses for the integration tests (and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from ports import free_port
from waiting import wait_until

from tandem.contracts.block_key import BlockKey
from tandem.kvstore.client import KVStoreClient
from tandem.kvstore.index import IndexEntry


class StoreNodeProcess:
    """``tandem kvstore`` in a subprocess (UCX is not fork-safe: never forked)."""

    def __init__(self, redis_url: str, node_id: str, capacity_bytes: int, *,
                 heartbeat_ttl_s: float = 10.0, transfer_timeout_s: float = 30.0,
                 log_dir: Path | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.node_id = node_id
        self.port = free_port()
        self.metrics_port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        args = [sys.executable, "-P", "-m", "tandem.kvstore.server",
                "--listen", self.address, "--capacity", str(capacity_bytes),
                "--redis-url", redis_url, "--node-id", node_id,
                "--metrics-port", str(self.metrics_port),
                "--heartbeat-ttl-s", str(heartbeat_ttl_s),
                "--transfer-timeout-s", str(transfer_timeout_s), *extra_args]
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
        self.log_path = (log_dir or Path("/tmp")) / f"kvstore-{node_id}-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def health(self) -> int | None:
        """HTTP status of /health, ``None`` when not answering."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/health", timeout=1
            ) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=2) as r:
            return r.read().decode()

    def wait_ready(self, client: KVStoreClient, timeout_s: float = 60.0) -> None:
        """Poll until the node is registered (live) in the index."""

        def live() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"store node exited with {self.proc.returncode}: "
                    f"{self.log_path.read_text()[-2000:]}")
            try:
                return self.node_id in client.live_nodes()
            except Exception:  # noqa: BLE001 - Redis may be restarting
                return False

        wait_until(live, timeout_s, f"store node {self.node_id} to be live")

    def kill(self) -> None:
        """SIGKILL: the node dies without deregistering (its heartbeat must expire)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def poll(predicate, timeout_s: float = 30.0, interval_s: float = 0.05) -> None:  # noqa: ANN001
    """Wait until ``predicate()`` is true; AssertionError after ``timeout_s``."""
    wait_until(predicate, timeout_s, interval_s=interval_s, error=AssertionError)


def corrupt_block(client: KVStoreClient, redis_url: str, key: BlockKey) -> None:
    """Flip the first byte of ``key``'s stored block in its node's pool.

    Fault injection through the test's own access to the node's shared-memory
    segment (kvstore/shm.py: the file behind the registry's ``shm_path``, writable
    by the same user): the store's protocol has no operation for it.
    """
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        entry = IndexEntry.decode(r.get(key.redis_key))
    finally:
        r.close()
    assert entry is not None, f"{key} is not in the index"
    info = client.live_nodes()[entry.node_id]
    assert info.shm_path, f"node {entry.node_id} has no shared-memory pool (--no-shm)"
    offset = entry.slot * int(client.stat(entry.node_id)["slot_bytes"])  # type: ignore[call-overload]
    fd = os.open(info.shm_path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0xFF]), offset)
    finally:
        os.close(fd)
