"""Starting the stack's parts as child processes: ports, health waits, stopping.

Used by ``tandem up`` (``tandem.up.Stack``), the benchmarks and the test harnesses.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; another process may take it
    before the caller binds, so a caller that can bind port 0 itself should)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
