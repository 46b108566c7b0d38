"""`tandem kvstore`: one KV store node (UCX data plane, Redis index).

    tandem kvstore --listen HOST:PORT --capacity BYTES --redis-url URL
                   [--node-id ID] [--metrics-port PORT] [--heartbeat-ttl-s S]
                   [--block-ttl-s S] [--slot-bytes N] [--transfer-timeout-s S]
                   [--no-shm] [--shm-lease-s S]
                   [--disk-path DIR --disk-capacity BYTES] [--disk-write-queue-bytes N]

The node preallocates ``--capacity`` bytes of host memory (kvstore/pool.py),
registers itself in Redis with its UCX worker address and a heartbeat TTL,
and serves batched put/get requests (kvstore/protocol.py): payloads move
between the wire and pool slots directly. ``--listen HOST:PORT`` is the node's
address in the registry (what ``--kvstore HOST:PORT`` of prefill/decode names
as their local node); HTTP ``/health`` and ``/metrics`` are served on
``--metrics-port`` (default: the ``--listen`` port). The pool lives in a
shared-memory segment that clients on the same host read directly
(kvstore/shm.py); ``--no-shm`` keeps it private (UCX reads only).
``--disk-path`` adds a disk tier behind the pool (kvstore/node_disk.py): blocks evicted
from RAM are kept there, read back on a get, and registered again when a node starts on
the same directory; a directory that cannot be written or lacks ``--disk-capacity`` of
room is a start-up error (exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.contracts.tracing import TracingConfig, add_tracing_flags, start_tracing
from tandem.kvstore.config import NodeConfig, UcxOptions, parse_bytes
from tandem.kvstore.disk_scan import probe_directory
from tandem.kvstore.node import StoreNode

__all__ = ["NodeConfig", "StoreNode", "build_parser", "config_from_args", "main", "parse_bytes",
           "serve"]


def _start_http(node: StoreNode, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's API
            if self.path.startswith("/metrics"):
                body, ctype, code = generate_latest(node.metrics.registry), \
                    CONTENT_TYPE_LATEST, 200
            elif self.path.startswith("/health"):
                status = {"status": "ok" if node.redis_ok else "degraded",
                          "node_id": node.cfg.node_id, "redis": node.redis_ok,
                          "num_blocks": node.pool.num_blocks}
                body, ctype = json.dumps(status).encode(), "application/json"
                code = 200 if node.redis_ok else 503
            else:
                body, ctype, code = b"not found", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, name="kvstore-http", daemon=True).start()
    return server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem kvstore", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT advertised as this node's address")
    p.add_argument("--capacity", required=True, type=parse_bytes,
                   help="pool size in bytes (suffixes K/M/G[iB] accepted)")
    p.add_argument("--redis-url", required=True, help="Redis of the block index")
    p.add_argument("--node-id", default=None, help="registry id (default: host-port-random)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="HTTP /health and /metrics port (default: the --listen port)")
    p.add_argument("--heartbeat-ttl-s", type=float, default=10.0)
    p.add_argument("--block-ttl-s", type=float, default=None,
                   help="drop blocks this many seconds after their put")
    p.add_argument("--slot-bytes", type=parse_bytes, default=None,
                   help="fix the slot size (default: the first block's size)")
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--no-prefault", action="store_true",
                   help="map pool pages lazily instead of touching them all at start")
    p.add_argument("--no-shm", action="store_true",
                   help="keep the pool in private memory (no same-host shared-memory reads)")
    p.add_argument("--shm-lease-s", type=float, default=30.0,
                   help="unpin a shared-memory read's blocks after this long without release")
    p.add_argument("--disk-path", default=None,
                   help="directory of a disk tier behind the pool (blocks evicted from RAM; "
                        "kept across restarts); default: RAM only")
    p.add_argument("--disk-capacity", type=parse_bytes, default=0,
                   help="bytes the disk tier may take (suffixes K/M/G/T[iB]); needs --disk-path")
    p.add_argument("--disk-write-queue-bytes", type=parse_bytes, default=256 << 20,
                   help="evicted bytes waiting for their disk write at most; evictions "
                        "beyond are not kept (counted)")
    p.add_argument("--log-level", default="INFO")
    add_tracing_flags(p)
    return p


def config_from_args(argv: list[str], environ: Mapping[str, str] | None = None) -> NodeConfig:
    """Parse flags (and ucxx's ``UCXPY_*`` variables of ``environ``, default
    ``os.environ``: :meth:`UcxOptions.from_environ`) into a :class:`NodeConfig`.
    Raises SystemExit on bad flags."""
    parser = build_parser()
    a = parser.parse_args(argv)
    host, sep, port = a.listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        parser.error(f"--listen must be HOST:PORT with a port in 0..65535, got {a.listen!r}")
    try:
        return NodeConfig(
            host=host or "127.0.0.1", port=int(port), capacity_bytes=a.capacity,
            redis_url=a.redis_url,
            node_id=a.node_id or f"{socket.gethostname()}-{port}-{uuid.uuid4().hex[:6]}",
            metrics_port=int(port) if a.metrics_port is None else a.metrics_port,
            heartbeat_ttl_s=a.heartbeat_ttl_s, block_ttl_s=a.block_ttl_s,
            slot_bytes=a.slot_bytes, transfer_timeout_s=a.transfer_timeout_s,
            prefault=not a.no_prefault, shm=not a.no_shm, shm_lease_s=a.shm_lease_s,
            ucx=UcxOptions.from_environ(os.environ if environ is None else environ),
            disk_path=a.disk_path, disk_capacity_bytes=a.disk_capacity,
            disk_write_queue_bytes=a.disk_write_queue_bytes,
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


async def serve(cfg: NodeConfig, tracing: TracingConfig | None = None) -> None:
    """Run a node until SIGTERM/SIGINT; ``tracing``: its OpenTelemetry export (off)."""
    node = StoreNode(cfg)
    node.tracing = start_tracing(tracing or TracingConfig(service_name="tandem-kvstore"))
    if node.tracing.enabled:
        node.metrics.registry.register(node.tracing)
    http = _start_http(node, cfg.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await node.start()
    print(f"kvstore ready node_id={cfg.node_id} metrics_port={http.server_address[1]}",
          flush=True)
    await stop.wait()
    await node.stop()
    node.tracing.shutdown()  # exports what is queued
    http.shutdown()
    logging.shutdown()
    # NOTE: ucxx's teardown can block on endpoints of clients that went away; the
    # registry entry is already removed and no state needs flushing, so leave now.
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tandem kvstore``. Returns the exit code."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(args)
    if cfg.disk_path is not None:
        try:
            probe_directory(Path(cfg.disk_path), cfg.disk_capacity_bytes)
        except ValueError as exc:
            print(f"tandem kvstore: error: {exc}", file=sys.stderr)
            return 2
    ns = build_parser().parse_args(args)
    try:
        tracing = TracingConfig.from_args(ns, os.environ, "tandem-kvstore")
    except ValueError as exc:
        print(f"tandem kvstore: error: {exc}", file=sys.stderr)
        return 2
    level = ns.log_level.upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(cfg, tracing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
