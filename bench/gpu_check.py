"""``make gpu-check``: the checks of tandem's CUDA path, on a machine with a CUDA GPU.

Run it with ``bash bench/gpu_check.sh`` (or ``make gpu-check``): it needs torch, Triton,
transformers, safetensors, psutil, numpy and pytest, installs nothing, and imports
``tandem`` from the checkout (the repository root on PYTHONPATH); docs/deploy.md says how,
with and without a registry.
The models are random-weight Hugging Face folders built on the spot
(bench/gpu_check_models.py), not the default model's GGUF.

Each check runs in a process of its own under a time budget (``BUDGETS``; all together
under ``TOTAL_BUDGET_S``, 7.5 minutes): a check that fails, crashes or runs out of time is
recorded and the next one still runs.

1. ``kernels``: the Triton kernel tests natively on the GPU (``TANDEM_TEST_DEVICE=cuda``),
   the CPU-side CUDA-graph, attention-backend and transfer-path tests, and the CUDA-gated
   e2e test ``test_cuda_runner_matches_hf``; passes when pytest passes, the e2e test ran
   (not skipped) and at least one Triton test ran natively;
2. ``greedy``: tandem vs transformers greedy tokens in float32 and bfloat16, with CUDA
   graphs (replays per captured size) and with ``enforce_eager``, and float32 graphs vs
   eager; a prompt's tokens may leave the reference's only at a near-tie
   (bench/gpu_check_rules.py); then seeded temperature sampling in float16 (both sampler
   paths, repeatable);
3. ``masked_gqa``: masked GQA prefills at a 32k context (later chunks, a prefix-cache hit)
   in float32 and bfloat16; the peak allocation stays within ``gpu_memory_utilization``;
4. ``kv_staging``: a CUDA cache's blocks through the KV store's host staging and back,
   bit-equal;
5. ``decode_steps``: decode step times at batch 1, 32 and 128, each size's graph replayed;
6. ``two_engines``: two engine processes on the GPU at ``gpu_memory_utilization=0.4``
   each, the second started once the first has allocated its KV cache (as ``tandem up``
   starts engines sharing a GPU), both generating, each within its share;
7. ``parallel``: bench/gpu_parallel.sh (TP/PP), only with two GPUs or more (its budget
   comes on top of the 7.5 minutes).

Writes one JSON report (``--out``; logs and the models beside it) and exits 0 when every
check passed, 1 when one did not, 2 (writing nothing) where torch sees no CUDA GPU.
``--device cpu`` is a dry run of the script's own logic on the CPU (smaller sizes; memory
rules and graph replays not measured; budgets ``DRY_RUN_BUDGET_SCALE`` times the GPU's;
the report says ``"dry_run": true``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = [
    "tests/unit/test_kernels_triton.py",
    "tests/unit/test_quant_triton.py",
    "tests/unit/test_cuda_graphs.py",
    "tests/unit/test_attention_backend.py",
    "tests/unit/test_kv_transfer_path.py",
]
E2E_TEST = "tests/e2e/test_model_runner.py::test_cuda_runner_matches_hf"
#: where the checks run by default (``--device cpu``: a dry run of the logic)
DEVICE = "cuda"
#: seconds per check, in the order they run (a one-GPU machine: 450 s in all)
BUDGETS = {"kernels": 130, "greedy": 120, "masked_gqa": 50, "kv_staging": 20,
           "decode_steps": 60, "two_engines": 70}
TOTAL_BUDGET_S = 450
PARALLEL_BUDGET_S = 300
#: a dry run (``--device cpu``) checks the logic, not the time: on a small shared CPU its
#: engines take longer than a GPU's, so its budgets are this many times the GPU's
DRY_RUN_BUDGET_SCALE = 3.0
#: packages the engine can run without; the report says which are there
OPTIONAL = ("gguf", "xgrammar", "redis", "ucxx", "uvloop", "fastapi", "jsonschema")


def cuda_status() -> tuple[bool, str]:
    """(whether torch sees a CUDA GPU, what it found): torch itself, not ``nvidia-smi``,
    which a machine may have without a CUDA build of torch (or lack with one)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch cannot be imported ({exc})"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return False, (f"torch {torch.__version__} (CUDA build {torch.version.cuda}) sees no "
                       "CUDA GPU")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return True, f"torch {torch.__version__} sees {names}"


def nvidia_smi_list() -> str | None:
    """``nvidia-smi -L``'s output, or None where it is missing, fails or hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=15,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def environment(device: str) -> dict[str, Any]:
    """Versions and devices, for the report."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable,
        "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                 if device.startswith("cuda") else []),
        "nvidia_smi": nvidia_smi_list(),
        "optional_packages": {n: _importable(n) for n in OPTIONAL},
    }
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


# -- the checks that are not engine runs ---------------------------------------------------------


def test_outcomes(junit_xml: str) -> dict[str, str]:
    """pytest's JUnit XML as ``{"<classname>.<name>": outcome}``, outcome one of
    passed, failed, error, skipped."""
    outcomes = {}
    for case in ET.fromstring(junit_xml).iter("testcase"):
        tags = {child.tag for child in case}
        outcome = next((t for t in ("failure", "error", "skipped") if t in tags), "passed")
        outcome = {"failure": "failed"}.get(outcome, outcome)
        outcomes[f"{case.get('classname')}.{case.get('name')}"] = outcome
    return outcomes


def kernel_tests_passed(returncode: int, outcomes: dict[str, str], device: str) -> bool:
    """The kernel check's rule: pytest passed and, on CUDA, the e2e test ran and passed
    and at least one Triton test ran natively (a skip there means the GPU path was not
    tested)."""
    if returncode != 0 or not outcomes:
        return False
    if not device.startswith("cuda"):
        return True
    e2e = [o for k, o in outcomes.items() if k.endswith("test_model_runner.test_cuda_runner_"
                                                        "matches_hf")]
    triton = [o for k, o in outcomes.items() if ".test_kernels_triton." in f".{k}"]
    return e2e == ["passed"] and "passed" in triton


def check_kernels(ctx: Any) -> dict[str, Any]:
    """The kernel tests and the CUDA e2e test (pytest, ``python -P``, in a subprocess)."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env.pop("TRITON_INTERPRET", None)
    if ctx.device.startswith("cuda"):
        env["TANDEM_TEST_DEVICE"] = "cuda"
    junit = ctx.out_dir / "kernel_tests.xml"
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *KERNEL_TESTS, E2E_TEST]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(10.0, ctx.budget_s - 10), check=False)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        rc, log = -1, f"timed out after {exc.timeout:.0f} s\n{partial}"
    (ctx.out_dir / "kernel_tests.log").write_text(log)
    outcomes = test_outcomes(junit.read_text()) if junit.exists() else {}
    counts = {o: sum(v == o for v in outcomes.values())
              for o in ("passed", "failed", "error", "skipped")}
    lines = log.strip().splitlines()
    return {"passed": kernel_tests_passed(rc, outcomes, ctx.device), "returncode": rc,
            "counts": counts, "not_passed": {k: v for k, v in outcomes.items() if v != "passed"},
            "summary": lines[-1] if lines else "", "command": " ".join(cmd)}


def check_parallel(ctx: Any) -> dict[str, Any]:
    """bench/gpu_parallel.sh (TP and PP over two GPUs)."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONSAFEPATH="1")
    proc = subprocess.run(["bash", "bench/gpu_parallel.sh", str(ctx.out_dir / "parallel"), "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=max(10.0, ctx.budget_s - 10), check=False)
    (ctx.out_dir / "parallel.log").write_text(proc.stdout + proc.stderr)
    report = ctx.out_dir / "parallel" / "gpu_parallel.json"
    return {"passed": proc.returncode == 0,
            "report": json.loads(report.read_text()) if report.exists() else None}


def _checks() -> dict[str, Callable[[Any], dict[str, Any]]]:
    from tandem.bench import gpu_check_runs

    return {"kernels": check_kernels, **gpu_check_runs.CHECKS, "parallel": check_parallel}


# -- running the checks ------------------------------------------------------------------------


def run_child(name: str, device: str, out_dir: Path, budget_s: float) -> dict[str, Any]:
    """Check ``name`` in a child process (``--child``) killed at ``budget_s``; its result,
    or a failure saying why there is none, with what it saved before it was cut off
    (``Context.save_partial``) and the log's tail."""
    result_path = out_dir / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    log_path = out_dir / f"{name}.log"
    cmd = [sys.executable, "-P", "-m", "tandem.bench.gpu_check", "--child", name,
           "--device", device, "--out", str(result_path), "--budget", str(budget_s)]
    with open(log_path, "w") as log:
        # its own session: a timeout ends its subprocesses (pytest, engine workers) too
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONSAFEPATH="1"),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    return collect_result(result_path, log_path, rc, timed_out, budget_s)


def collect_result(result_path: Path, log_path: Path, returncode: int, timed_out: bool,
                   budget_s: float) -> dict[str, Any]:
    """A finished child's result; or, where it has none or only a partial one (it was cut
    off, or died), a failure saying why, with the partial result and the log's tail."""
    result = json.loads(result_path.read_text()) if result_path.exists() else None
    if result is not None and not result.get("incomplete") and not timed_out:
        return result
    why = (f"timed out after its {budget_s:.0f} s budget" if timed_out
           else f"exit status {returncode}")
    return {**(result or {}), "passed": False, "timed_out": timed_out,
            "error": f"{'incomplete' if result else 'no'} result: {why}",
            "log_tail": log_path.read_text(errors="replace")[-3000:]}


def plan(only: list[str] | None, num_gpus: int) -> list[tuple[str, float]]:
    """The checks to run and their budgets, in order: ``BUDGETS``'s, plus ``parallel``
    with two GPUs or more (or when asked for by name)."""
    budgets = dict(BUDGETS, parallel=PARALLEL_BUDGET_S)
    names = list(only) if only else [*BUDGETS, *(["parallel"] if num_gpus >= 2 else [])]
    return [(n, float(budgets[n])) for n in names]


def child_main(args: argparse.Namespace) -> int:
    """One check in this process; writes its result to ``args.out``."""
    from tandem.bench.gpu_check_runs import Context

    out = Path(args.out)
    ctx = Context(device=args.device, out_dir=out.parent, budget_s=args.budget,
                  result_path=out)
    try:
        result = _checks()[args.child](ctx)
    except Exception as exc:  # noqa: BLE001 - recorded in the report
        result = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    out.write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """The ``make gpu-check`` command line (see the module docstring); returns the exit
    status."""
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="build/gpu-check/report.json",
                   help="the JSON report's path (logs and models go beside it)")
    p.add_argument("--only", action="append", choices=[*BUDGETS, "parallel"],
                   help="run this check only; repeat for several (default: all)")
    p.add_argument("--device", default=DEVICE,
                   help="cuda (default), or cpu for a dry run of the script's logic")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args)
    dry_run = not args.device.startswith("cuda")
    if not dry_run:
        ok, found = cuda_status()
        if not ok:
            print(f"gpu-check: no CUDA GPU here: {found}; nothing was run "
                  "(--device cpu dry-runs the script's logic)", file=sys.stderr)
            return 2
        print(f"gpu-check: {found}", file=sys.stderr, flush=True)
    import torch

    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    num_gpus = torch.cuda.device_count() if not dry_run else 0
    scale = DRY_RUN_BUDGET_SCALE if dry_run else 1.0
    todo = [(name, budget * scale) for name, budget in plan(args.only, num_gpus)]
    total_budget = (TOTAL_BUDGET_S + (PARALLEL_BUDGET_S if num_gpus >= 2 else 0)) * scale
    deadline = start + total_budget
    report: dict[str, Any] = {"passed": False, "device": args.device, "dry_run": dry_run,
                              "environment": environment(args.device),
                              "budget_s": total_budget, "checks": {}}
    if num_gpus == 1 and not args.only:
        report["checks"]["parallel"] = {"passed": True, "skipped": "1 GPU (TP/PP needs 2)"}
    for name, budget in todo:
        left = deadline - time.monotonic()
        print(f"gpu-check: {name} (budget {min(budget, left):.0f} s) ...", file=sys.stderr,
              flush=True)
        t0 = time.monotonic()
        if left < 10:
            result = {"passed": False, "error": "not run: the total time budget was spent"}
        else:
            result = run_child(name, args.device, out.parent, min(budget, left))
        result["elapsed_s"] = time.monotonic() - t0
        result["budget_s"] = budget
        report["checks"][name] = result
        print(f"gpu-check: {name}: {'passed' if result['passed'] else 'FAILED'} "
              f"({result['elapsed_s']:.0f} s)", file=sys.stderr, flush=True)
        out.write_text(json.dumps(report, indent=2))  # partial results survive a crash
    report["elapsed_s"] = time.monotonic() - start
    report["passed"] = all(r["passed"] for r in report["checks"].values())
    out.write_text(json.dumps(report, indent=2))
    print(f"gpu-check: {'passed' if report['passed'] else 'FAILED'}; wrote {out}",
          file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
