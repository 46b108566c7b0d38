"""`tandem serve --role prefill|decode|both`: one binary for every engine role.

``both`` is the colocated engine: prefill and decode in one engine, no KV
store; it serves DecodeService, called without ``first_token_id`` (see
protos/tandem/v1/decode.proto). ``prefill`` and ``decode`` are the same as
``tandem prefill`` / ``tandem decode``.
"""

from __future__ import annotations

import sys

from tandem.services.common.server import run


def main(argv: list[str] | None = None) -> int:
    """Serve the engine in ``--role``; returns the exit code. Flags: ``--help``."""
    return run(argv, prog="tandem serve", role=None)


if __name__ == "__main__":
    sys.exit(main())
