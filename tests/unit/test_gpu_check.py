"""``make gpu-check`` (bench/gpu_check.py and its helpers) off a GPU: it refuses clearly,
its pass rules decide as documented (the greedy near-tie rule on synthetic cases and on a
tiny model), its report has the documented shape (a ``--device cpu`` dry run), a check
past its budget is cut off, and ``tandem`` imports from a checkout without pip (the
repository root on PYTHONPATH, as bench/gpu_check.sh puts it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.bench import gpu_check, gpu_check_rules, gpu_check_runs
from tandem.bench.gpu_check_rules import (
    greedy_passed,
    is_near_tie,
    tie_threshold,
    within_budget,
)

ROOT = Path(gpu_check.__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_it_says_so_and_fails(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU here" in err and "sees no CUDA GPU" in err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_the_shell_entry_exits_2_without_cuda(tmp_path):
    """bench/gpu_check.sh (what `make gpu-check` runs): no pip, `tandem` from the checkout
    (the repository root on PYTHONPATH), the same exit status 2, nothing written."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--out",
                           str(tmp_path / "r.json")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU here" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_the_shell_entry_without_a_python_exits_2(tmp_path):
    env = dict(os.environ, PYTHON=str(tmp_path / "no-python"))
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "no Python" in proc.stderr


def test_cuda_status_reads_torch_not_nvidia_smi(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, found = gpu_check.cuda_status()
    assert not ok and "sees no CUDA GPU" in found


def test_nvidia_smi_missing_or_failing_is_none(monkeypatch):
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    assert gpu_check.nvidia_smi_list() is None
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: "/bin/false")
    assert gpu_check.nvidia_smi_list() is None


# -- the greedy near-tie rule ----------------------------------------------------------------


def _div(gap: float, noise: float, **extra: object) -> dict:
    return {"prompt": 0, "index": 3, "gap": gap, "noise": noise, **extra}


@pytest.mark.parametrize(
    ("gap", "noise", "dtype", "tie"),
    [
        (0.0, 0.0, "float32", True),
        (9e-4, 0.0, "float32", True),  # under float32's floor
        (0.01, 0.0, "float32", False),  # a float32 kernel off by more than rounding
        (0.15, 0.05, "bfloat16", True),  # ordinary bf16 noise: 3x its size
        (-0.15, 0.05, "bfloat16", True),  # tandem took the one float32 ranks higher
        (0.19, 0.05, "bfloat16", True),
        (0.21, 0.05, "bfloat16", False),  # past 4x the noise
        (0.015, 0.0, "bfloat16", True),  # the floor where the noise reads ~0
        (0.5, 0.05, "bfloat16", False),  # what the old fixed 0.5 gap let through
        (2.0, 0.1, "bfloat16", False),  # a wrong token
    ],
)
def test_near_tie_rule(gap, noise, dtype, tie):
    assert is_near_tie(_div(gap, noise), dtype) is tie


def test_tie_threshold_is_the_floor_or_a_multiple_of_the_noise():
    assert tie_threshold(0.0, "bfloat16") == gpu_check_rules.TIE_FLOOR["bfloat16"]
    assert tie_threshold(0.1, "bfloat16") == pytest.approx(0.1 * gpu_check_rules.TIE_NOISE_FACTOR)
    assert tie_threshold(0.0, "float32") == gpu_check_rules.TIE_FLOOR["float32"]


def test_a_length_mismatch_is_never_a_tie():
    assert not is_near_tie({"prompt": 0, "index": 5, "length_mismatch": True}, "bfloat16")


def test_greedy_passes_on_ties_and_replays_only():
    ties = {"divergences": [_div(0.1, 0.05), _div(0.0, 0.01)], "graph_replays_by_size": {8: 3}}
    assert greedy_passed(ties, "bfloat16", need_replays=True)
    assert not greedy_passed({**ties, "graph_replays_by_size": {}}, "bfloat16", True)
    assert greedy_passed({**ties, "graph_replays_by_size": {}}, "bfloat16", False)
    one_off = {**ties, "divergences": [*ties["divergences"], _div(1.0, 0.05)]}
    assert not greedy_passed(one_off, "bfloat16", need_replays=True)
    assert greedy_passed({"divergences": [], "graph_replays_by_size": {1: 1}}, "float32", True)


def test_agreement_counts_equal_prompts_and_common_prefixes():
    got = gpu_check_rules.agreement([[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 6], [8]])
    assert got == {"num_prompts": 3, "num_equal": 1, "first_token_equal": False,
                   "common_prefix_tokens": [3, 1, 0]}


@pytest.fixture(scope="module")
def tiny_hf():
    from tiny_models import tiny_config, tiny_hf_model

    return tiny_hf_model(tiny_config("LlamaForCausalLM", vocab=50, hidden=32, ffn=48,
                                     special_tokens=False), std=0.3)


def test_divergences_name_the_index_gap_noise_and_verdict(tiny_hf):
    """The judge teacher-forced on the common prefix: a stream that leaves transformers'
    at index 2 for its second choice is reported with the float32 gap there; with the
    judge itself as the dtype's model the noise is 0, so the float32 floor decides."""
    prompt = [3, 14, 15, 9]
    ref = gpu_check_runs.hf_greedy(tiny_hf, prompt, 5)
    with torch.inference_mode():
        logits = tiny_hf(input_ids=torch.tensor([prompt + ref[:2]])).logits[0, -1]
    top = logits.topk(2)
    second = int(top.indices[1])
    got = ref[:2] + [second] + ref[3:]
    found = gpu_check_rules.divergences(tiny_hf, tiny_hf, [prompt, prompt], [ref, ref],
                                       [ref, got], "float32")
    gap = float(top.values[0] - top.values[1])
    assert found == [{"prompt": 1, "index": 2, "ref_token": ref[2], "token": second,
                      "gap": pytest.approx(gap), "noise": 0.0,
                      "threshold": gpu_check_rules.TIE_FLOOR["float32"], "rank": 1,
                      "near_tie": gap <= gpu_check_rules.TIE_FLOOR["float32"]}]


def test_divergences_measure_the_dtype_noise(tiny_hf):
    """With a bfloat16 copy as the dtype's model, ``noise`` is how far its logits are from
    the judge's there (not 0), and the threshold grows with it."""
    import copy

    rounded = copy.deepcopy(tiny_hf).to(torch.bfloat16)
    prompt = [1, 2, 3]
    ref = gpu_check_runs.hf_greedy(tiny_hf, prompt, 3)
    got = [ref[0], (ref[1] + 1) % 50, ref[2]]
    (rec,) = gpu_check_rules.divergences(tiny_hf, rounded, [prompt], [ref], [got], "bfloat16")
    assert rec["index"] == 1 and rec["noise"] > 0
    assert rec["threshold"] == tie_threshold(rec["noise"], "bfloat16")


def test_divergences_report_a_length_mismatch(tiny_hf):
    found = gpu_check_rules.divergences(tiny_hf, tiny_hf, [[1, 2]], [[5, 6, 7]], [[5, 6]],
                                       "float32")
    assert found == [{"prompt": 0, "index": 2, "length_mismatch": True, "near_tie": False}]


# -- memory, kernel tests, staging -------------------------------------------------------------


def test_memory_budget_rule():
    gib = 1 << 30
    assert within_budget(None, gib)  # no peak counter off CUDA
    assert within_budget(gib, gib)
    assert within_budget(gib + (64 << 20), gib)  # inside the slack
    assert not within_budget(2 * gib, gib)


def test_an_engine_sharing_a_gpu_must_get_its_share():
    share = 32 << 30
    assert gpu_check_rules.got_its_share(30 << 30, 28 << 30, share)
    assert not gpu_check_rules.got_its_share(40 << 30, 28 << 30, share)  # over its share
    assert not gpu_check_rules.got_its_share(2 << 30, 1 << 30, share)  # sized from too little
    assert not gpu_check_rules.got_its_share(None, None, share)



def test_two_engines_start_one_after_the_other(tmp_path, monkeypatch):
    """The second engine is told to wait for the first's KV cache (``--after a``), as
    ``tandem up`` starts engines sharing a GPU: an engine's memory profile counts the
    device-wide rise in used memory as its own."""
    cmds = []

    class Proc:
        def __init__(self, cmd, **kwargs):
            cmds.append(cmd)

        def wait(self, timeout=None):
            return 0

        def kill(self):
            pass

    monkeypatch.setattr(gpu_check_runs, "ensure_model", lambda name, root: tmp_path / name)
    monkeypatch.setattr(gpu_check_runs.subprocess, "Popen", Proc)
    result = gpu_check_runs.check_two_engines(gpu_check_runs.Context("cpu", tmp_path, 60.0))
    assert result["passed"] and [c[c.index("--name") + 1] for c in cmds] == ["a", "b"]
    assert "--after" not in cmds[0]
    assert cmds[1][cmds[1].index("--after") + 1] == "a"


def test_the_second_engine_builds_nothing_without_the_first(tmp_path):
    rc = gpu_check_runs.engine_worker([
        "--model", str(tmp_path / "none"), "--device", "cpu", "--name", "b", "--peer", "a",
        "--dir", str(tmp_path), "--util", "0.1", "--max-len", "64", "--wait-s", "0.2",
        "--after", "a"])
    assert rc == 1 and not (tmp_path / "b.ready").exists()
    report = json.loads((tmp_path / "b.json").read_text())
    assert report == {"started_after": "a", "error": "a never allocated its KV cache"}

JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="tests.unit.test_kernels_triton" name="test_a"/>
<testcase classname="tests.unit.test_kernels_triton" name="test_rerun"><skipped/></testcase>
<testcase classname="tests.unit.test_cuda_graphs" name="test_b"><failure/></testcase>
<testcase classname="tests.e2e.test_model_runner" name="test_cuda_runner_matches_hf"/>
</testsuite></testsuites>"""


def test_kernel_test_outcomes_and_rule():
    outcomes = gpu_check.test_outcomes(JUNIT)
    assert outcomes == {"tests.unit.test_kernels_triton.test_a": "passed",
                        "tests.unit.test_kernels_triton.test_rerun": "skipped",
                        "tests.unit.test_cuda_graphs.test_b": "failed",
                        "tests.e2e.test_model_runner.test_cuda_runner_matches_hf": "passed"}
    ok = {k: v for k, v in outcomes.items() if v != "failed"}
    assert gpu_check.kernel_tests_passed(0, ok, "cuda")
    assert not gpu_check.kernel_tests_passed(1, ok, "cuda")
    assert not gpu_check.kernel_tests_passed(0, {}, "cuda")
    e2e = "tests.e2e.test_model_runner.test_cuda_runner_matches_hf"
    assert not gpu_check.kernel_tests_passed(0, {**ok, e2e: "skipped"}, "cuda")
    assert gpu_check.kernel_tests_passed(0, {**ok, e2e: "skipped"}, "cpu")  # a dry run
    no_triton = {k: v for k, v in ok.items() if "triton" not in k}
    assert not gpu_check.kernel_tests_passed(0, no_triton, "cuda")


def test_the_kernel_check_lists_the_cuda_e2e_test():
    assert gpu_check.E2E_TEST.endswith("test_model_runner.py::test_cuda_runner_matches_hf")
    assert (ROOT / gpu_check.E2E_TEST.split("::")[0]).exists()
    assert all((ROOT / t).exists() for t in gpu_check.KERNEL_TESTS)


def test_staging_round_trip_on_the_cpu():
    """The GPU check's staging round trip is device-agnostic: on CPU tensors it runs
    the same copies through a (pageable) host buffer."""
    got = gpu_check_runs.staging_round_trip("cpu")
    assert got["passed"]
    assert got["plan"]["path"] == "host_staging" and not got["plan"]["pinned"]
    assert got["num_blocks"] == 6


# -- running: the plan, the budget, the report ---------------------------------------------------


def test_plan_fits_eight_minutes_and_adds_parallel_with_two_gpus():
    one = gpu_check.plan(None, 1)
    assert [n for n, _ in one] == list(gpu_check.BUDGETS)
    assert sum(b for _, b in one) <= gpu_check.TOTAL_BUDGET_S < 8 * 60
    assert [n for n, _ in gpu_check.plan(None, 2)][-1] == "parallel"
    assert gpu_check.plan(["greedy"], 1) == [("greedy", gpu_check.BUDGETS["greedy"])]


def test_a_check_past_its_budget_is_cut_off(tmp_path):
    result = gpu_check.run_child("kv_staging", "cpu", tmp_path, budget_s=0.05)
    assert result["passed"] is False and result["timed_out"] is True
    assert "budget" in result["error"]


def test_a_check_cut_off_keeps_what_it_saved(tmp_path):
    """``Context.save_partial`` before the cut: the report keeps those figures, marked
    failed and incomplete; a finished result is taken as it is."""
    result, log = tmp_path / "greedy.result.json", tmp_path / "greedy.log"
    log.write_text("loading...\n")
    ctx = gpu_check_runs.Context("cpu", tmp_path, 10.0, result_path=result)
    ctx.save_partial({"float32": {"passed": True}})
    got = gpu_check.collect_result(result, log, -9, True, 10.0)
    assert got["float32"] == {"passed": True} and got["incomplete"] is True
    assert got["passed"] is False and got["timed_out"] is True
    assert got["error"] == "incomplete result: timed out after its 10 s budget"
    assert got["log_tail"] == "loading...\n"
    result.write_text(json.dumps({"passed": True, "x": 1}))
    assert gpu_check.collect_result(result, log, 0, False, 10.0) == {"passed": True, "x": 1}
    result.unlink()
    assert gpu_check.collect_result(result, log, 1, False, 10.0)["error"] == (
        "no result: exit status 1")


def test_a_check_that_raises_is_recorded(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(gpu_check, "_checks", lambda: {"greedy": broken})
    out = tmp_path / "greedy.result.json"
    assert gpu_check.main(["--child", "greedy", "--device", "cpu", "--out", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["passed"] is False and result["error"] == "RuntimeError: boom"
    assert "Traceback" in result["traceback"]


def test_dry_run_report_shape(tmp_path):
    """``--device cpu --only kv_staging``: one child process, one report with the
    environment, the budget and the check's result; exit 0 when it passed."""
    out = tmp_path / "report.json"
    assert gpu_check.main(["--device", "cpu", "--only", "kv_staging", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"passed", "device", "dry_run", "environment", "budget_s",
                           "elapsed_s", "checks"}
    assert report["passed"] is True and report["dry_run"] is True and report["device"] == "cpu"
    env = report["environment"]
    assert {"torch", "triton", "transformers", "gpus", "nvidia_smi", "optional_packages"} <= set(
        env)
    assert set(env["optional_packages"]) == set(gpu_check.OPTIONAL)
    check = report["checks"]["kv_staging"]
    assert check["passed"] and check["budget_s"] == (gpu_check.BUDGETS["kv_staging"]
                                                     * gpu_check.DRY_RUN_BUDGET_SCALE)
    assert report["budget_s"] == gpu_check.TOTAL_BUDGET_S * gpu_check.DRY_RUN_BUDGET_SCALE
    assert check["elapsed_s"] > 0 and check["plan"]["path"] == "host_staging"
    assert (tmp_path / "kv_staging.log").exists()


# -- the models, the checkout on PYTHONPATH -------------------------------------------------------------


def test_greedy_model_weights_are_exact_in_bfloat16(tmp_path):
    from safetensors.torch import load_file

    from tandem.bench.gpu_check_models import ensure_model

    folder = ensure_model("greedy", tmp_path)
    assert (folder / ".complete").exists() and ensure_model("greedy", tmp_path) == folder
    weights = load_file(str(folder / "model.safetensors"))
    for name, w in weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, w.to(torch.bfloat16).float()), name
    config = json.loads((folder / "config.json").read_text())
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4
    assert config["eos_token_id"] is None
    with pytest.raises(ValueError, match="model must be one of"):
        ensure_model("nope", tmp_path)


def test_the_checkout_root_on_pythonpath_adds_only_tandem(tmp_path):
    """What bench/gpu_check.sh does, from another folder: with -P and only the repository
    root on PYTHONPATH, `tandem` and its subpackages come from this checkout and no
    top-level `kernels` or `engine` does (a folder without __init__.py is at most a
    namespace portion, which an installed distribution of that name always beats)."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = ("import importlib.util, tandem.engine.config, tandem.bench.gpu_check as g, "
            "tandem.v1; s = importlib.util.find_spec('kernels'); "
            "print(g.ROOT, s.origin if s else None)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    root, kernels = proc.stdout.split()
    assert Path(root) == ROOT
    assert kernels == "None" or not kernels.startswith(str(ROOT / "kernels"))
    assert not any((ROOT / d / "__init__.py").exists()
                   for d in ("engine", "kernels", "kvstore", "services", "contracts", "bench"))
