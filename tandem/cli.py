"""`tandem` command line: a thin dispatcher to each component's own entry point.

Each subcommand lives in the module that owns it and exposes ``main(argv) -> int``;
modules are imported lazily so that `tandem router` never imports torch and
`tandem up` never imports UCX.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping

# subcommand -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("tandem.up", "start store, prefill, decode and router (or colocated engines)"),
    "router": ("tandem.services.router.main", "OpenAI-compatible HTTP + gRPC gateway"),
    "prefill": ("tandem.services.prefill.main", "gRPC prefill service"),
    "decode": ("tandem.services.decode.main", "gRPC decode service"),
    "serve": ("tandem.services.serve", "gRPC engine service: --role prefill|decode|both"),
    "kvstore": ("tandem.kvstore.server", "KV block store node (UCX data plane)"),
    "bench": ("tandem.bench.main", "benchmarks: throughput | latency | serve | kvstore"),
    "tune": ("tandem.bench.tune", "find the configuration with the highest goodput meeting an SLO"),
}


# Commands that run engines or services side by side with others (several
# processes on a few cores): they get OpenMP settings that keep idle workers
# off the cores. The offline API and the benchmarks keep libgomp's defaults.
_SERVICE_COMMANDS = frozenset({"up", "router", "prefill", "decode", "serve", "kvstore"})


def configure_openmp(command: str) -> None:
    """Set the OpenMP wait defaults of a service ``command`` (values already in
    the environment win); other commands are left alone.

    NOTE: libgomp's default lets an idle worker spin ~3 ms (300000 spins) before
    sleeping. When the host is oversubscribed (prefill, decode, router and store
    on 2 cores) a spinning thread steals the core its peer needs. Sleeping at once
    (PASSIVE alone) made every parallel region wake its peer through the kernel instead
    (both measured: docs/benchmarks.md, "Offline throughput"), so workers spin ~0.1 ms
    (10000 spins), then sleep. Both must be in the environment before torch loads libgomp.
    """
    if command in _SERVICE_COMMANDS:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


# Commands that run models: the kernel backend is configured from the
# environment here, once (the router imports no kernels, hence no torch).
_MODEL_COMMANDS = frozenset({"prefill", "decode", "serve", "bench"})


def configure_kernels(command: str) -> None:
    """Build the kernel config of a model ``command`` from the environment
    (``TANDEM_CPU_KERNELS``, ``TANDEM_CACHE_DIR``, ``CC``, ``TANDEM_CPU_ISA``; see
    ``tandem.kernels.backend.KernelConfig.from_env``); other commands are left alone.

    Raises:
        ValueError: on a ``TANDEM_CPU_ISA`` no machine has.
    """
    if command in _MODEL_COMMANDS:
        from tandem.kernels import backend

        backend.configure(backend.KernelConfig.from_env(os.environ))


def _before_command(command: str) -> None:
    """What runs before a command's module is imported: OpenMP and kernel settings."""
    configure_openmp(command)
    configure_kernels(command)


def usage(prog: str, noun: str, commands: Mapping[str, tuple[str, str]]) -> str:
    """The help text of a dispatcher: ``prog``'s ``noun``s with their one-line help."""
    width = max(map(len, commands)) + 3
    lines = [f"usage: {prog} <{noun}> [options]", "", f"{noun}s:"]
    lines += [f"  {name:<{width}} {helptext}" for name, (_, helptext) in commands.items()]
    lines.append("")
    lines.append(f"Run `{prog} <{noun}> --help` for a {noun}'s options.")
    return "\n".join(lines)


def dispatch(
    prog: str,
    noun: str,
    commands: Mapping[str, tuple[str, str]],
    argv: list[str],
    before: Callable[[str], None] | None = None,
) -> int:
    """Run the ``noun`` named by ``argv[0]``: import its module (``commands[name][0]``)
    only now and return ``int(module.main(argv[1:]) or 0)``.

    ``-h`` / ``--help`` or no argument prints the usage and returns 0; an unknown name
    prints it to stderr and returns 2. ``before(name)`` runs before the import (settings
    that must be in the environment before a library loads).
    """
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog, noun, commands))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown {noun} {name!r}\n\n{usage(prog, noun, commands)}",
              file=sys.stderr)
        return 2
    if before is not None:
        before(name)
    module = importlib.import_module(commands[name][0])
    return int(module.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tandem` console script. Returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from tandem import __version__

        print(__version__)
        return 0
    return dispatch("tandem", "command", _COMMANDS, argv, before=_before_command)


if __name__ == "__main__":
    sys.exit(main())
