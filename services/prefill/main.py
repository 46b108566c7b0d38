"""`tandem prefill`: the gRPC prefill service (engine in prefill role, publishes KV blocks)."""

from __future__ import annotations

import sys

import grpc

from tandem.contracts.role import Role
from tandem.services.common.context import ServiceContext
from tandem.services.common.server import run


def add_servicers(ctx: ServiceContext, server: grpc.aio.Server) -> list[str]:
    """Add ``PrefillService`` over ``ctx`` to ``server``; returns its full service name."""
    # Imported here: `tandem prefill --help` should not pay for the engine.
    from tandem.services.prefill.servicer import PrefillServicer
    from tandem.v1 import prefill_pb2, prefill_pb2_grpc

    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(ctx), server)
    return [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name]


def main(argv: list[str] | None = None) -> int:
    """Serve PrefillService until SIGTERM; returns the exit code. Flags: ``--help``."""
    return run(argv, prog="tandem prefill", role=Role.PREFILL,
               servicers={Role.PREFILL: add_servicers})


if __name__ == "__main__":
    sys.exit(main())
