"""`tandem decode`: the gRPC decode service (pulls KV blocks from the store, streams tokens)."""

from __future__ import annotations

import sys

import grpc

from tandem.contracts.role import Role
from tandem.services.common.context import ServiceContext
from tandem.services.common.server import run


def add_servicers(ctx: ServiceContext, server: grpc.aio.Server) -> list[str]:
    """Add ``DecodeService`` over ``ctx`` to ``server``; returns its full service name.

    The colocated role serves the same service, called without ``first_token_id``.
    """
    # Imported here: `tandem decode --help` should not pay for the engine.
    from tandem.services.decode.servicer import DecodeServicer
    from tandem.v1 import decode_pb2, decode_pb2_grpc

    decode_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(ctx), server)
    return [decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]


def main(argv: list[str] | None = None) -> int:
    """Serve DecodeService until SIGTERM; returns the exit code. Flags: ``--help``."""
    return run(argv, prog="tandem decode", role=Role.DECODE, servicers={Role.DECODE: add_servicers})


if __name__ == "__main__":
    sys.exit(main())
