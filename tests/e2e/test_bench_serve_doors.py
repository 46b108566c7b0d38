"""`tandem bench serve --endpoint-type` through each of the router's doors, end to end.

One colocated engine with the tiny random-weight Llama (float32) behind one `tandem
router`; the bench runs a few requests through completions, chat, responses and messages
and its report must count every door's output tokens exactly. ``--structured json`` (a
schema no output of its length completes) forces each output to its ``max_tokens`` on the
doors that refuse ``ignore_eos``; chat also runs with ``--ignore-eos``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from ports import free_port

from tandem.bench import serve
from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

NUM_PROMPTS = 3
OUTPUT_LEN = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(router URL, tiny model folder)."""
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    launcher = Launcher(tmp_path_factory.mktemp("bench_doors"))
    eng_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512"),
            lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        launcher.launch([Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--model", tiny, "--colocated", f"127.0.0.1:{eng_port}"),
            lambda: http_ok(f"{url}/ready"))], 300)
        yield url, tiny
    finally:
        launcher.close(timeout_s=30)


def _bench(url: str, tiny: str, out: Path, *flags: str) -> list[dict]:
    argv = ["--url", url, "--tokenizer", tiny, "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN),
            "--max-concurrency", "2", "--json", str(out), *flags]
    assert serve.main(argv) == 0
    doc = json.loads(out.read_text())
    return doc if isinstance(doc, list) else [doc]


def test_every_door_reports_its_exact_output_tokens(stack, tmp_path, capsys) -> None:
    url, tiny = stack
    results = _bench(url, tiny, tmp_path / "doors.json", "--structured", "json",
                     "--endpoint-type", "completions", "chat", "responses", "messages")
    assert [m["endpoint_type"] for m in results] == ["completions", "chat", "responses",
                                                     "messages"]
    for m in results:
        door = m["endpoint_type"]
        assert (m["completed"], m["failed"]) == (NUM_PROMPTS, 0), (door, m["errors"])
        assert m["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS, door
        assert m["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN, door
        # the text doors count the templated prompt the router reports: longer than the ids
        lens = m["input_lens"]
        assert all(n >= 16 for n in lens) if door != "completions" else lens == [16] * 3
        # every door's streamed text is what the grammar allows: a JSON object's start
        assert all(t.startswith("{") for t in m["generated_texts"]), (door, m)
        assert all(0 < len(itl) <= OUTPUT_LEN for itl in m["itls"]), door
        assert m["mean_ttft_ms"] > 0 and m["output_throughput"] > 0
    printed = capsys.readouterr().out
    assert "| inf | messages | 18 |" in printed  # the doors' table


def test_chat_with_ignore_eos_runs_every_output_to_its_length(stack, tmp_path) -> None:
    url, tiny = stack
    (m,) = _bench(url, tiny, tmp_path / "chat.json", "--endpoint-type", "chat", "--ignore-eos")
    assert (m["completed"], m["failed"]) == (NUM_PROMPTS, 0), m["errors"]
    assert m["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert m["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN


@pytest.mark.parametrize("door", ["responses", "messages"])
def test_a_door_that_refuses_ignore_eos_is_refused_before_any_request(door, capsys) -> None:
    assert serve.main(["--url", "http://127.0.0.1:9", "--endpoint-type", door,
                       "--ignore-eos"]) == 2
    assert f"the {door} door(s) refuse ignore_eos" in capsys.readouterr().err
