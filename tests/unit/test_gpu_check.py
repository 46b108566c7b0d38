"""``make gpu-check`` (bench/gpu_check.py) off a GPU: it refuses clearly, and its
comparison helper counts what it should."""

from __future__ import annotations

import pytest
import torch

from tandem.bench import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_it_says_so_and_fails(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err
    assert not out.exists()


def test_agreement_counts_equal_prompts_and_common_prefixes():
    got = gpu_check._agreement([[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 6], [8]])
    assert got == {"num_prompts": 3, "num_equal": 1, "first_token_equal": False,
                   "common_prefix_tokens": [3, 1, 0]}


def test_staging_round_trip_on_the_cpu():
    """The GPU check's staging round trip is device-agnostic: on CPU tensors it runs
    the same copies through a (pageable) host buffer."""
    got = gpu_check.staging_round_trip("cpu")
    assert got["passed"]
    assert got["plan"]["path"] == "host_staging" and not got["plan"]["pinned"]
    assert got["num_blocks"] == 6


def test_divergences_name_the_index_gap_and_second_choice():
    """The greedy check's near-tie test (transformers teacher-forced on the common
    prefix) on a tiny random model: a token stream that leaves transformers' at index 2
    for its second choice is reported as such, with its top-2 gap."""
    from tiny_models import tiny_config, tiny_hf_model

    hf = tiny_hf_model(tiny_config("LlamaForCausalLM", vocab=50, hidden=32, ffn=48,
                                   special_tokens=False), std=0.3)
    prompt = [3, 14, 15, 9]
    ref = gpu_check._hf_greedy(hf, prompt, 5, None)
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt + ref[:2]])).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    got = ref[:2] + [second] + ref[3:]
    assert gpu_check._divergences(hf, [prompt, prompt], [ref, ref], [ref, got]) == [
        {"prompt": 1, "index": 2, "top2_gap": pytest.approx(float(logits.topk(2).values[0]
                                                                    - logits.topk(2).values[1])),
         "ours_is_second": True}
    ]
