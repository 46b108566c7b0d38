"""`tandem bench <name>`: dispatch to ``tandem.bench.<name>.main(argv)``.

Each benchmark owns its flags; modules are imported only when chosen, so the
serving benchmark does not import torch and the throughput one does not import UCX.
"""

from __future__ import annotations

import importlib
import sys

_BENCHMARKS: dict[str, str] = {
    "throughput": "offline engine vs transformers / llama.cpp: requests/s and tokens/s",
    "latency": "prefill -> store -> decode vs colocated: TTFT and inter-token latency",
    "serve": "HTTP serving load test against a running router",
    "kvstore": "KV store put/get bandwidth and latency",
}


def _usage() -> str:
    lines = ["usage: tandem bench <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<11} {text}" for name, text in _BENCHMARKS.items()]
    lines.append("")
    lines.append("Run `tandem bench <benchmark> --help` for its options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark; returns its exit code (2 for an unknown benchmark)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in _BENCHMARKS:
        print(f"tandem bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"tandem.bench.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
