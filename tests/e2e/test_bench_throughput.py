"""`tandem bench throughput` end to end on a tiny random Llama folder (tandem and hf)."""

from __future__ import annotations

import json

import torch
import transformers

from tandem.bench import main as bench_main
from tandem.bench import throughput


def test_bench_dispatch(capsys) -> None:
    assert bench_main.main(["--help"]) == 0
    assert "throughput" in capsys.readouterr().out
    assert bench_main.main(["no-such-bench"]) == 2


def test_throughput_tandem_and_hf(tmp_path, capsys) -> None:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
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
        "--json",
        str(out_json),
    ]
    assert throughput.main(argv) == 0
    printed = capsys.readouterr().out
    assert "tandem / hf" in printed
    doc = json.loads(out_json.read_text())
    assert set(doc["results"]) == {"tandem", "hf"}
    for r in doc["results"].values():
        assert r["num_output_tokens"] == 12
        assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    assert doc["ratios"]["tandem/hf"] > 0
    assert doc["machine"]["num_cpus"] >= 1


def test_prompts_are_fixed_by_seed() -> None:
    a = throughput.make_prompts(50, {0, 1}, 4, 6, seed=3)
    assert a == throughput.make_prompts(50, {0, 1}, 4, 6, seed=3)
    assert a != throughput.make_prompts(50, {0, 1}, 4, 6, seed=4)
    assert all(len(p) == 6 and all(2 <= t < 50 for t in p) for p in a)
