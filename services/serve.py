"""`tandem serve --role prefill|decode|both`: one binary for every engine role.

``both`` is the colocated engine: prefill and decode in one engine, no KV
store; it serves DecodeService, called without ``first_token_id`` (see
protos/tandem/v1/decode.proto). ``prefill`` and ``decode`` are the same as
``tandem prefill`` / ``tandem decode``.
"""

from __future__ import annotations

import sys

from tandem.contracts.role import Role
from tandem.services.common.server import run
from tandem.services.decode.main import add_servicers as add_decode
from tandem.services.prefill.main import add_servicers as add_prefill


def main(argv: list[str] | None = None) -> int:
    """Serve the engine in ``--role``; returns the exit code. Flags: ``--help``."""
    return run(argv, prog="tandem serve", role=None,
               servicers={Role.PREFILL: add_prefill, Role.DECODE: add_decode, Role.BOTH: add_decode})


if __name__ == "__main__":
    sys.exit(main())
