"""``tandem bench serve --launch-tracing``: the launched stack with OpenTelemetry tracing
off, on (every part exporting to an OTLP receiver in this process), or pointed at an
endpoint that is down (every span dropped), to measure what tracing costs a served load.

NOTE: the receiver runs in the benchmark's own process, so on a small host it takes CPU
from the stack as a collector on another machine would not; the cost measured is an upper
bound of the exporters' cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tandem.bench.otlp_receiver import OTLPReceiver
from tandem.launch import free_port

#: ``--launch-tracing`` values: no endpoint; this process's receiver; a port nobody serves.
TRACING_MODES = ("off", "on", "down")


@contextlib.contextmanager
def launch_tracing(mode: str) -> Iterator[tuple[list[str], OTLPReceiver | None]]:
    """The tracing flags of every launched part for ``mode`` and the receiver (``on``
    only; running until the block ends).

    Raises:
        ValueError: naming ``--launch-tracing`` for an unknown mode.
    """
    if mode not in TRACING_MODES:
        raise ValueError(
            f"--launch-tracing must be one of {', '.join(TRACING_MODES)}, got {mode!r}"
        )
    if mode == "off":
        yield [], None
    elif mode == "down":
        yield ["--otlp-traces-endpoint", f"http://127.0.0.1:{free_port()}/v1/traces"], None
    else:
        with OTLPReceiver() as receiver:
            yield ["--otlp-traces-endpoint", receiver.endpoint], receiver
