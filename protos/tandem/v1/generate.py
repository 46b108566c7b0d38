"""Generate the Python stubs of the tandem.v1 protos with grpcio-tools.

Run as ``python -P -m tandem.v1.generate`` (``make protos``). The ``.proto``
files live in ``protos/tandem/v1``; protoc runs with ``-I protos`` so the
generated modules import each other as ``tandem.v1.<name>_pb2``, which is where
pyproject maps ``protos/tandem/v1``. Output: ``<name>_pb2.py``, ``<name>_pb2.pyi``
and ``<name>_pb2_grpc.py`` next to each ``.proto`` (or under ``--out-dir``, used
by the test that checks the committed stubs are current).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: protos/ (the include root): this file is protos/tandem/v1/generate.py.
PROTO_ROOT = Path(__file__).resolve().parents[2]


def proto_files() -> list[Path]:
    """The ``.proto`` files of tandem.v1, sorted (relative paths as protoc sees them)."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "tandem" / "v1").glob("*.proto"))


def generate(out_dir: Path | None = None) -> list[Path]:
    """Run protoc on every tandem.v1 proto.

    Args:
        out_dir: output root (``tandem/v1/...`` is created under it); default
            ``protos/`` itself.

    Returns:
        Paths of the generated files.

    Raises:
        RuntimeError: protoc failed (its message is included).
    """
    from grpc_tools import protoc  # dev dependency: imported only when generating

    out = Path(out_dir) if out_dir is not None else PROTO_ROOT
    out.mkdir(parents=True, exist_ok=True)
    # grpc_tools ships the well-known types (google/protobuf/*.proto).
    wkt = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{wkt}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in proto_files()],
    ]
    # NOTE: protoc resolves relative proto paths against the include roots.
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}: {' '.join(args)}")
    generated = []
    for p in proto_files():
        stem = out / p.with_suffix("")
        generated += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return generated


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -P -m tandem.v1.generate [--out-dir DIR]``. Returns the exit code."""
    parser = argparse.ArgumentParser(prog="tandem.v1.generate", description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=None, help="output root (default protos/)")
    ns = parser.parse_args(argv)
    for path in generate(ns.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
