"""A store node's span of one request (``put`` / ``get``) that carries a trace context.

A client whose request is traced sends its W3C context as the control message's ``trace``
(``{"traceparent": ..., "tracestate": ...}``, ``kvstore/protocol.py``); the node then
records ``tandem.kvstore.<op>`` under it, with the blocks, bytes and tier it serves.
Without ``trace``, or when the node does not trace, nothing is built.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from tandem.contracts.tracing import Tracing


def request_span(tracing: Tracing, op: object, msg: dict[str, Any]) -> trace.Span | None:
    """The span of request ``msg`` (op ``op``), started now under its ``trace`` context
    (end it when the request is served); ``None`` when tracing is off or the carrier is
    not a dict of strings."""
    carrier = msg.get("trace")
    if not tracing.enabled or not isinstance(carrier, dict):
        return None
    parent = tracing.extract({str(k): str(v) for k, v in carrier.items()})
    keys = msg.get("keys") or []
    attrs: dict[str, Any] = {"tandem.kv.blocks": len(keys), "tandem.kv.tier": "ram"}
    sizes = msg.get("sizes")
    if isinstance(sizes, list):
        attrs["tandem.kv.bytes"] = sum(int(s) for s in sizes)
    return tracing.span(
        f"tandem.kvstore.{op}", parent, kind=trace.SpanKind.SERVER, attributes=attrs
    )
