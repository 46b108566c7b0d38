"""A store node's end of one client connection over UCX (kvstore/node.py serves it)."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.kvstore import protocol as proto


class Conn:
    """One client connection: our endpoint to it and the ids each side chose."""

    def __init__(self, conn_id: int, peer_conn_id: int, ep: Any) -> None:
        self.conn_id = conn_id
        self.peer_conn_id = peer_conn_id
        self.ep = ep
        self.closed = False

    async def reply(self, request_id: int, msg: dict[str, Any]) -> None:
        tag = proto.make_tag(self.peer_conn_id, request_id, proto.CTRL_PART)
        await self.ep.send(proto.encode(msg), tag=tag, force_tag=True)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.ep.abort()

    async def close_with_bye(self, reason: str) -> None:
        """Tell the client (best effort) that this connection is dropped, then abort it."""
        if self.closed:
            return
        try:
            await asyncio.wait_for(self.reply(0, {"op": "bye", "reason": reason}), 1.0)
        except Exception:  # noqa: BLE001 - client may be gone; abort regardless
            pass
        self.abort()
