"""`tandem bench <name>`: dispatch to ``tandem.bench.<name>.main(argv)``.

Each benchmark owns its flags; modules are imported only when chosen, so the
serving benchmark does not import torch and the throughput one does not import UCX.
"""

from __future__ import annotations

import sys

from tandem.cli import dispatch

# benchmark -> (module, one-line help)
_BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("tandem.bench.throughput",
                   "offline engine vs transformers / llama.cpp: requests/s and tokens/s"),
    "latency": ("tandem.bench.latency",
                "prefill -> store -> decode vs colocated: TTFT and inter-token latency"),
    "serve": ("tandem.bench.serve", "HTTP serving load test against a running router"),
    "mixed": ("tandem.bench.mixed",
              "short streams beside long prompts against a running router: how prefill "
              "and decode share the compute"),
    "kvstore": ("tandem.bench.kvstore", "KV store put/get bandwidth and latency"),
    "router-ceiling": ("tandem.bench.router_ceiling",
                       "the router's own cost per streamed token, against a decode stub"),
    "rate-limit": ("tandem.bench.rate_limit",
                   "per-API-key limits under concurrent clients: admitted tokens per minute "
                   "against the limit, and the routers' per-tenant counters"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark; returns its exit code (2 for an unknown benchmark)."""
    return dispatch("tandem bench", "benchmark", _BENCHMARKS,
                    list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
