"""engine/model_files.py and engine/gguf_metadata.py: the router's tokenizer without torch,
and `tandem router`'s start-up importing no torch, kernels or models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.engine.gguf_metadata import read_gguf_metadata
from tandem.engine.model_files import default_model_path, load_tokenizer, model_id_of

_TESTS = str(Path(__file__).resolve().parents[1])

# Texts whose ids pin the tokenizer: special tokens whole, digits, runs of spaces and
# newlines, accents, CJK, an emoji (bytes split across tokens).
_TEXTS = [
    "Hello world",
    " leading space and  two   spaces\n\nnewlines\ttab",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "numbers 1234567 3.14159 -42",
    "caf\u00e9 na\u00efve \u00fcber \u4f60\u597d\u4e16\u754c \U0001f600!",
    "def f(x):\n    return x ** 2  # square",
    "",
]
_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]

# Runs `tandem router` through the CLI entry point in this process until /health answers,
# asks it to stop (SIGTERM, as `tandem up` does), then prints the forbidden modules loaded.
_ROUTER_STARTUP = textwrap.dedent("""
    import json, os, signal, sys, threading, urllib.request
    sys.path.insert(0, sys.argv[1])
    from ports import free_port
    from waiting import wait_until
    from tandem import cli

    port = free_port()

    def healthy():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop_when_up():
        wait_until(healthy, 300, "router /health")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_up, daemon=True).start()
    rc = cli.main(["router", "--host", "127.0.0.1", "--port", str(port),
                   "--grpc-port", str(free_port()), "--colocated", f"127.0.0.1:{free_port()}",
                   "--log-level", "warning"])
    bad = sorted(m for m in sys.modules if m.split(".")[0] == "torch"
                 or m.startswith(("tandem.kernels", "tandem.engine.models",
                                  "tandem.engine.model_loader")))
    print(json.dumps({"rc": rc, "bad": bad}))
""")


def test_router_startup_imports_no_torch() -> None:
    """Bug: `tandem router` loaded its tokenizer and model facts through
    ``engine.model_loader``, which imports torch and every model and kernel module,
    although the router runs no model (~20 CPU-seconds and ~380 MB at start-up)."""
    out = subprocess.run([sys.executable, "-P", "-c", _ROUTER_STARTUP, _TESTS],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"rc": 0, "bad": []}, out.stderr[-3000:]


def _write_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.context_length", 4096)
    w.add_int32("t.i32", -7)
    w.add_uint64("t.u64", 1 << 40)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "caf\u00e9 \U0001f600")
    w.add_array("t.strs", ["a", "", "\u4f60\u597d"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.25, -1.5])
    w.add_tensor("w", np.zeros((2, 3), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_metadata_matches_gguf_reader(tmp_path: Path) -> None:
    """Every key and value as ``gguf.GGUFReader`` (the format's reference reader) reads it."""
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    ours = read_gguf_metadata(str(path))
    fields = gguf.GGUFReader(str(path)).fields
    theirs = {k: f.contents() for k, f in fields.items() if not k.startswith("GGUF.")}
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value) if "float" in key or "f32" in key \
            else ours[key] == value, key
    assert ours["t.strs"] == ["a", "", "\u4f60\u597d"] and ours["t.u64"] == 1 << 40


def test_gguf_metadata_rejects_bad_files(tmp_path: Path) -> None:
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf_metadata(str(not_gguf))
    good = tmp_path / "m.gguf"
    _write_gguf(good)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:200])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_metadata(str(cut))
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf_metadata(str(old))


def test_default_model_id_and_tokenizer() -> None:
    tokenizer = load_tokenizer(None)
    assert model_id_of(None) == "SmolLM2-135M-Instruct.Q4_1"
    assert (len(tokenizer), tokenizer.eos_token_id) == (49152, 2)


def _assert_same_tokenizer(ours: object, theirs: object) -> None:
    assert len(ours) == len(theirs)  # type: ignore[arg-type]
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "chat_template",
                 "clean_up_tokenization_spaces"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    for text in _TEXTS:
        ids = theirs.encode(text)  # type: ignore[attr-defined]
        assert ours.encode(text) == ids, text  # type: ignore[attr-defined]
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(  # type: ignore[attr-defined]
            text, add_special_tokens=False), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(  # type: ignore[attr-defined]
                ids, skip_special_tokens=skip), text
    if theirs.chat_template:  # type: ignore[attr-defined]
        for gen in (False, True):
            assert ours.apply_chat_template(_CHAT, tokenize=False, add_generation_prompt=gen) \
                == theirs.apply_chat_template(_CHAT, tokenize=False,  # type: ignore[attr-defined]
                                              add_generation_prompt=gen)


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers_gguf_path() -> None:
    """Same ids, decodes and chat rendering as ``AutoTokenizer.from_pretrained(gguf_file=)``
    (the path the router took before, which imports torch)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), local_files_only=True,
                                           gguf_file=os.path.basename(path))
    ours = load_tokenizer(None)
    _assert_same_tokenizer(ours, theirs)


def test_hf_folder_tokenizer(tmp_path: Path) -> None:
    """A Hugging Face folder: the tokenizer its tokenizer_config.json names, the same as
    ``AutoTokenizer`` gives."""
    from transformers import AutoTokenizer

    default = load_tokenizer(None)
    default.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "max_position_embeddings": 1024, "vocab_size": 49152,
        "eos_token_id": [2, 0]}))
    ours = load_tokenizer(str(tmp_path))
    assert model_id_of(str(tmp_path)) == tmp_path.name
    _assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(tmp_path, local_files_only=True))


def test_unknown_model_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model .* not found"):
        load_tokenizer(str(tmp_path / "missing"))
