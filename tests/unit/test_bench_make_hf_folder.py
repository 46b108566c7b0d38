"""`python -m tandem.bench.make_hf_folder`: the inputs it refuses before loading anything
(the conversion itself loads the 135M model, too slow for the unit suite)."""

from __future__ import annotations

import pytest

from tandem.bench.make_hf_folder import main, make_hf_folder


def test_rejects_an_unknown_dtype(tmp_path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        make_hf_folder(str(tmp_path / "out"), str(tmp_path / "m.gguf"), dtype="int8")


def test_rejects_a_folder_model(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a .gguf file"):
        make_hf_folder(str(tmp_path / "out"), str(tmp_path))


def test_refuses_to_overwrite_a_model(tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds a model"):
        make_hf_folder(str(tmp_path / "out"), str(gguf))


def test_main_reports_errors_with_exit_code_2(tmp_path, capsys) -> None:
    assert main([str(tmp_path / "out"), "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
