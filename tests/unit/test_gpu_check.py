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
