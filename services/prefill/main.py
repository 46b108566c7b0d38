"""`tandem prefill`: the gRPC prefill service (engine in prefill role, publishes KV blocks)."""

from __future__ import annotations

import sys

from tandem.contracts.role import Role
from tandem.services.common.server import run


def main(argv: list[str] | None = None) -> int:
    """Serve PrefillService until SIGTERM; returns the exit code. Flags: ``--help``."""
    return run(argv, prog="tandem prefill", role=Role.PREFILL)


if __name__ == "__main__":
    sys.exit(main())
