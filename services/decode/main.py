"""`tandem decode`: the gRPC decode service (pulls KV blocks from the store, streams tokens)."""

from __future__ import annotations

import sys

from tandem.contracts.role import Role
from tandem.services.common.server import run


def main(argv: list[str] | None = None) -> int:
    """Serve DecodeService until SIGTERM; returns the exit code. Flags: ``--help``."""
    return run(argv, prog="tandem decode", role=Role.DECODE)


if __name__ == "__main__":
    sys.exit(main())
