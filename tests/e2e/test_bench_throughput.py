"""`tandem bench throughput` end to end on a tiny random Llama folder (tandem and hf)."""

from __future__ import annotations

import json

import pytest
from tiny_models import tiny_config, tiny_hf_model

from tandem.bench import main as bench_main
from tandem.bench import throughput, throughput_peers


def test_bench_dispatch(capsys) -> None:
    assert bench_main.main(["--help"]) == 0
    assert "throughput" in capsys.readouterr().out
    assert bench_main.main(["no-such-bench"]) == 2


def test_throughput_tandem_and_hf(tmp_path, capsys) -> None:
    config = tiny_config("LlamaForCausalLM", vocab=128, hidden=32, ffn=64)
    tiny_hf_model(config).save_pretrained(tmp_path / "tiny")
    out_json = tmp_path / "r.json"
    argv = [
        "--backend",
        "tandem",
        "--backend",
        "hf",
        "--model",
        str(tmp_path / "tiny"),
        "--num-prompts",
        "3",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--dtype",
        "float32",
        "--hf-batch-size",
        "2",
        "--repeat",
        "3",
        "--json",
        str(out_json),
    ]
    assert throughput.main(argv) == 0
    printed = capsys.readouterr().out
    assert "tandem / hf" in printed
    doc = json.loads(out_json.read_text())
    assert set(doc["results"]) == {"tandem", "hf"}
    for r in doc["results"].values():
        assert r["num_output_tokens"] == 12  # per pass
        assert len(r["runs_s"]) == 3 and r["elapsed_s"] == sorted(r["runs_s"])[1]
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    assert doc["ratios"]["tandem/hf"] > 0
    t, h = doc["results"]["tandem"], doc["results"]["hf"]
    assert doc["paired_ratios"]["tandem/hf"] == [
        pytest.approx(hs / ts) for ts, hs in zip(t["runs_s"], h["runs_s"], strict=True)
    ]
    assert "per pass" in printed
    assert doc["machine"]["num_cpus"] >= 1


def test_prompts_are_fixed_by_seed() -> None:
    a = throughput.make_prompts(50, {0, 1}, 4, 6, seed=3)
    assert a == throughput.make_prompts(50, {0, 1}, 4, 6, seed=3)
    assert a != throughput.make_prompts(50, {0, 1}, 4, 6, seed=4)
    assert all(len(p) == 6 and all(2 <= t < 50 for t in p) for p in a)


def test_throughput_llama_cpp_peer_runs(tmp_path) -> None:
    """The llama.cpp peer on the default GGUF, in a subprocess (a crash inside
    ggml must fail this test, not kill pytest). On AMX CPUs ggml's AMX buffers
    are turned off (they died with a general protection fault on the dev box)."""
    import subprocess
    import sys

    import pytest

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the optional bench extra")
    out_json = tmp_path / "r.json"
    argv = ["--backend", "llama.cpp", "--num-prompts", "2", "--input-len", "64",
            "--output-len", "4", "--json", str(out_json)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "throughput", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out_json.read_text())["results"]["llama.cpp"]
    assert result["num_output_tokens"] == 8
    assert result["ggml_amx_buffers"] is (not throughput_peers._cpu_has_amx())


def test_llama_cpp_backend_without_the_extra_names_it(monkeypatch, capsys) -> None:
    """llama-cpp-python is the optional `bench` extra: asking for its backend without
    it fails at once (before any other backend loads) and says what to install."""
    import importlib.util
    import sys

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name == "llama_cpp" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SystemExit) as exc:
        throughput.parse_args(["--backend", "tandem", "--backend", "llama.cpp"])
    assert exc.value.code == 2
    assert "tandem-serve[bench]" in capsys.readouterr().err
    assert throughput.parse_args(["--backend", "hf"]).backend == ["hf"]

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes the import fail
    args = throughput.parse_args(["--backend", "hf"])
    with pytest.raises(ImportError, match=r"tandem-serve\[bench\]"):
        throughput_peers.run_llama_cpp(args, [[[1, 2, 3]]])


def test_repeats_report_the_median_and_must_agree() -> None:
    import pytest

    counts = iter([5, 5, 5])
    timed = throughput._run_interleaved({"a": lambda prompts: next(counts)}, [[[1]], [[2]], [[3]]])
    assert timed["a"]["num_output_tokens"] == 5 and len(timed["a"]["runs_s"]) == 3
    assert timed["a"]["elapsed_s"] == sorted(timed["a"]["runs_s"])[1]
    uneven = iter([5, 4])
    with pytest.raises(RuntimeError, match="different output token counts"):
        throughput._run_interleaved({"a": lambda prompts: next(uneven)}, [[[1]], [[2]]])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--repeat", "0"])


def test_backends_run_pass_by_pass() -> None:
    """Pass i of every backend runs before pass i + 1 of any, on the same prompts,
    so the per-pass ratios compare runs taken next to each other."""
    calls: list[tuple[str, int]] = []

    def runner(name: str):
        def run_one(prompts: list[list[int]]) -> int:
            calls.append((name, prompts[0][0]))
            return 7

        return run_one

    sets = [[[10]], [[11]], [[12]]]
    timed = throughput._run_interleaved({"tandem": runner("tandem"), "hf": runner("hf")}, sets)
    assert calls == [("tandem", 10), ("hf", 10), ("tandem", 11), ("hf", 11),
                     ("tandem", 12), ("hf", 12)]  # fmt: skip
    assert [len(r["runs_s"]) for r in timed.values()] == [3, 3]


def _side_by_side(tmp_path, capsys, args: list[str]) -> tuple[str, dict]:
    """``tandem bench throughput ARGS`` on a tiny random Llama (it must exit 0): what it
    printed and its ``--json`` document."""
    config = tiny_config("LlamaForCausalLM", vocab=128, hidden=32, ffn=64)
    tiny_hf_model(config).save_pretrained(tmp_path / "tiny")
    out_json = tmp_path / "r.json"
    assert throughput.main(["--model", str(tmp_path / "tiny"), *args, "--json",
                            str(out_json)]) == 0
    return capsys.readouterr().out, json.loads(out_json.read_text())


def test_throughput_with_speculative_config(tmp_path, capsys) -> None:
    """tandem and tandem+spec side by side on repeated prompts, with the acceptance."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    printed, doc = _side_by_side(tmp_path, capsys, [
        "--num-prompts", "2", "--input-len", "16", "--output-len", "12", "--dtype", "float32",
        "--prompt-pattern", "repeated", "--speculative-config", spec])
    assert "tandem+spec / tandem" in printed and "acceptance rate" in printed
    assert set(doc["results"]) == {"tandem", "tandem+spec"}
    assert doc["results"]["tandem+spec"]["num_output_tokens"] == 24
    sp = doc["speculative"]
    assert sp["num_draft_tokens"] > 0 and 0 <= sp["acceptance_rate"] <= 1
    assert sp["mean_acceptance_length"] == pytest.approx(
        1 + sp["num_accepted_tokens"] / sp["num_drafts"])
    with pytest.raises(SystemExit):
        throughput.main(["--speculative-config", '{"method": "nope"}'])
    assert throughput.parse_args(["--temperature", "0.7"]).temperature == 0.7
    with pytest.raises(SystemExit):
        throughput.main(["--temperature", "1", "--backend", "hf"])  # tandem only


def test_throughput_with_deterministic(tmp_path, capsys) -> None:
    """tandem and tandem+det (batch-invariant kernels) side by side, pass by pass."""
    printed, doc = _side_by_side(tmp_path, capsys, [
        "--num-prompts", "3", "--input-len", "16", "--output-len", "8", "--dtype", "bfloat16",
        "--repeat", "2", "--deterministic"])
    assert "tandem+det / tandem" in printed and "got other greedy tokens" in printed
    assert set(doc["results"]) == {"tandem", "tandem+det"}
    assert doc["results"]["tandem+det"]["num_output_tokens"] == 24
    det = doc["deterministic"]
    assert len(det["paired_ratios"]) == 2 and det["ratio"] > 0
    assert 0 <= det["requests_with_other_tokens"] <= 6


def test_throughput_reports_the_kv_cache_a_budget_holds(tmp_path, capsys) -> None:
    """--kv-cache-dtype fp8 at a fixed --kv-cache-memory: the report carries the cache's
    dtype, its tokens and bytes per token (a bf16 model's FP8 cache: one byte per value)."""
    args = ["--num-prompts", "2", "--input-len", "16", "--output-len", "4", "--dtype",
            "bfloat16", "--kv-cache-memory", str(1 << 20)]
    _, auto = _side_by_side(tmp_path / "a", capsys, args)
    _, fp8 = _side_by_side(tmp_path / "b", capsys, [*args, "--kv-cache-dtype", "fp8"])
    a, f = auto["results"]["tandem"], fp8["results"]["tandem"]
    assert (a["kv_cache_dtype"], f["kv_cache_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert a["kv_cache_bytes_per_token"] == 2 * f["kv_cache_bytes_per_token"]
    assert f["kv_cache_tokens"] == 2 * a["kv_cache_tokens"]
    assert a["weight_bytes"] == f["weight_bytes"] > 0


def test_parallel_report_per_step_cost_and_token_check(capsys) -> None:
    args = throughput.parse_args(["--tensor-parallel-size", "2", "--num-prompts", "2"])
    one = {"output_tokens_per_s": 100.0, "num_output_tokens": 200, "runs_s": [2.0, 2.5]}
    par = {"output_tokens_per_s": 50.0, "num_output_tokens": 200, "runs_s": [4.0, 4.0],
           "num_steps": 40,
           "collectives": [{"all_reduce": {"calls": 2400, "seconds": 2.0},
                            "gather": {"calls": 0, "seconds": 0.0}}] * 2}
    outputs = {"tandem": [[[1, 2], [3, 4]]], "tandem+par": [[[1, 2], [3, 5]]]}
    report = throughput.parallel_report(par, one, args, outputs)
    assert report["ratio"] == 0.5
    assert report["paired_ratios"] == [0.5, 0.625]
    assert report["ms_per_step"] == [{"all_reduce": 50.0}] * 2
    assert report["requests_with_other_tokens"] == 1
    assert "all_reduce 2400 calls 2000 ms (50.00 ms/step)" in capsys.readouterr().out


def test_make_tp_model_config_splits_at_tp_2_and_4() -> None:
    from tandem.bench import make_tp_model

    config = make_tp_model.make_config()
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (12, 4, 48)
    # the same K/V width per layer as SmolLM2-135M's 3 KV heads x 64
    assert config.num_key_value_heads * config.head_dim == 3 * 64
    with pytest.raises(ValueError, match="kv_heads"):
        make_tp_model.make_config(heads=12, kv_heads=5)
