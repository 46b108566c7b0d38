"""The committed tandem.v1 stubs are current with the .proto files, and import as tandem.v1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.v1 import generate


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    committed_root = generate.PROTO_ROOT
    fresh = generate.generate(tmp_path)
    assert fresh, "no stubs generated"
    stale = []
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = committed_root / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


def test_stubs_import_under_tandem_v1() -> None:
    from tandem.v1 import common_pb2, decode_pb2_grpc, generation_pb2_grpc, prefill_pb2_grpc

    assert hasattr(prefill_pb2_grpc, "PrefillServiceStub")
    assert hasattr(decode_pb2_grpc, "DecodeServiceStub")
    assert hasattr(generation_pb2_grpc, "GenerationServiceServicer")
    params = common_pb2.SamplingParams()
    assert not params.HasField("temperature"), "temperature must track presence"
    assert common_pb2.FinishReason.Value("FINISH_REASON_UNSPECIFIED") == 0
