"""``make gpu-check``: the checks of tandem's CUDA path, on a machine with a CUDA GPU.

Runs, each on its own (a failing check is recorded and the next one still runs):

1. ``kernels``: the Triton kernel tests natively on the GPU (``TANDEM_TEST_DEVICE=cuda``
   makes tests/unit/test_kernels_triton.py put its tensors on CUDA instead of using
   Triton's interpreter), with the CPU-side CUDA-graph, attention-backend and
   transfer-path tests;
2. ``greedy``: greedy tokens of the default model (SmolLM2-135M) on the GPU, tandem
   vs transformers, in float32 and bfloat16, with CUDA graphs (decode batches that
   shrink as requests finish, so several captured sizes replay), and float32 once
   more with ``enforce_eager`` (graphs vs eager);
3. ``kv_staging``: a CUDA cache's blocks through the KV store's pinned host staging
   (``ShardedKVCache.read_blocks`` / ``write_blocks``) and back, bytes compared;
4. ``throughput``: ``tandem bench throughput --backend tandem --backend hf --device
   cuda`` in bfloat16;
5. ``parallel``: bench/gpu_parallel.sh (TP/PP) when there are two GPUs or more.

Writes one JSON report (``--out``) and exits 0 when every check passed, 1 when one
failed, 2 (writing nothing) on a machine without CUDA.

Pass rules: kernel tests pass; greedy tokens equal transformers' for every prompt, or
leave them only at a near-tie: where they first differ, transformers' top-2 logit gap
(teacher-forced on the common prefix) is under ``TIE_GAP`` for the dtype and tandem
took transformers' second choice (another kernel order rounds differently; bf16 rounds
far more); at least one CUDA graph replayed; graphs vs eager in float32 differ in at
most 1/10 of the prompts (padded batches change GEMM shapes, hence reduction orders);
the staged blocks come back bit-equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNEL_TESTS = [
    "tests/unit/test_kernels_triton.py",
    "tests/unit/test_cuda_graphs.py",
    "tests/unit/test_attention_backend.py",
    "tests/unit/test_kv_transfer_path.py",
]
#: where the model checks run (a dry run of the script's own logic may point it elsewhere)
DEVICE = "cuda"
NUM_PROMPTS = 20
#: logit gap under which two top candidates count as a near-tie, per dtype
TIE_GAP = {"float32": 1e-3, "bfloat16": 0.5}
#: a new request's output length: 8, 9, ... tokens, so the decode batch shrinks by one
#: request per step at the end and several captured sizes (16, 8, 4, 2, 1) replay
MIN_NEW_TOKENS = 8


def _environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    info["nvidia_smi"] = smi.stdout.strip()
    return info


def check_kernels(out_dir: Path) -> dict[str, Any]:
    """The kernel tests on the GPU (pytest in a subprocess)."""
    env = dict(os.environ, TANDEM_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)
    (out_dir / "kernel_tests.log").write_text(proc.stdout + proc.stderr)
    lines = proc.stdout.strip().splitlines()
    return {"passed": proc.returncode == 0, "returncode": proc.returncode,
            "summary": lines[-1] if lines else "", "command": " ".join(cmd)}


def _prompts(tokenizer: Any) -> list[list[int]]:
    texts = [
        "The capital of France is", "def fibonacci(n):\n    ", "Once upon a time,",
        "The three primary colors are", "import numpy as np\n", "Water boils at",
        "A haiku about autumn:\n", "The largest planet in the solar system is",
        "SELECT name FROM users WHERE", "In 1969, the first person to walk on the moon",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    long = " ".join(texts) * 6
    prompts += [tokenizer.encode(long)[: 40 + 37 * i] for i in range(NUM_PROMPTS - len(texts))]
    return prompts


def _hf_greedy(model: Any, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """transformers' greedy tokens, up to ``n`` or through EOS (as tandem's output)."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, eos_token_id=eos, pad_token_id=eos)
    return list(out[0, len(prompt):].tolist())


def _tandem_greedy(dtype: str, prompts: list[list[int]], lens: list[int],
                   enforce_eager: bool) -> tuple[list[list[int]], dict[int, int]]:
    from tandem import LLM, SamplingParams

    with LLM(device=DEVICE, dtype=dtype, max_model_len=1024, max_num_seqs=32,
             enforce_eager=enforce_eager) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lens]
        outs = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
        graphs = runner.cuda_graphs
        replays = dict(graphs.num_replays) if graphs is not None else {}
    return [list(o.outputs[0].token_ids) for o in outs], replays


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    def prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                    min(len(x), len(y)))

    same = [x == y for x, y in zip(a, b, strict=True)]
    return {"num_prompts": len(a), "num_equal": sum(same),
            "first_token_equal": all(x[:1] == y[:1] for x, y in zip(a, b, strict=True)),
            "common_prefix_tokens": [prefix(x, y) for x, y in zip(a, b, strict=True)]}


def _divergences(hf: Any, prompts: list[list[int]], ref: list[list[int]],
                 got: list[list[int]]) -> list[dict[str, Any]]:
    """Where tandem's greedy tokens leave transformers', per prompt that differs: the
    index, transformers' top-2 logit gap there (teacher-forced on the common prefix)
    and whether tandem's token is transformers' second choice."""
    import torch

    found = []
    for k, (prompt, a, b) in enumerate(zip(prompts, ref, got, strict=True)):
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if i is None:
            continue
        ids = torch.tensor([prompt + a[:i]], device=hf.device)
        with torch.inference_mode():
            logits = hf(input_ids=ids).logits[0, -1].float()
        top = logits.topk(2)
        found.append({"prompt": k, "index": i,
                      "top2_gap": float(top.values[0] - top.values[1]),
                      "ours_is_second": int(top.indices[1]) == b[i]})
    return found


def check_greedy(out_dir: Path) -> dict[str, Any]:
    """tandem vs transformers greedy on the GPU in float32 and bfloat16; graphs vs eager."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.model_files import default_model_path, load_tokenizer

    tok = load_tokenizer(None)
    prompts = _prompts(tok)
    lens = [MIN_NEW_TOKENS + i for i in range(len(prompts))]
    path = default_model_path()
    result: dict[str, Any] = {"output_lens": lens, "prompt_lens": [len(p) for p in prompts],
                              "tie_gap": TIE_GAP}
    passed = True
    fp32_graphs: list[list[int]] = []
    for dtype in ("float32", "bfloat16"):
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path),
            dtype=getattr(torch, dtype)).eval().to(DEVICE)
        ref = [_hf_greedy(hf, p, n, tok.eos_token_id) for p, n in zip(prompts, lens, strict=True)]
        got, replays = _tandem_greedy(dtype, prompts, lens, enforce_eager=False)
        agree = _agreement(got, ref)
        agree["graph_replays_by_size"] = replays
        agree["divergences"] = _divergences(hf, prompts, ref, got)
        del hf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        if dtype == "float32":
            fp32_graphs = got
        near_ties = all(d["top2_gap"] < TIE_GAP[dtype] and d["ours_is_second"]
                        for d in agree["divergences"])
        agree["passed"] = near_ties and bool(replays)
        passed &= agree["passed"]
        result[dtype] = agree
    eager, _ = _tandem_greedy("float32", prompts, lens, enforce_eager=True)
    vs = _agreement(fp32_graphs, eager)
    vs["passed"] = 10 * (len(prompts) - vs["num_equal"]) <= len(prompts)
    passed &= vs["passed"]
    result["float32_graphs_vs_eager"] = vs
    result["passed"] = passed
    return result


def check_kv_staging(out_dir: Path) -> dict[str, Any]:
    """A CUDA cache's blocks through pinned host staging and back into another cache."""
    return staging_round_trip(DEVICE)


def staging_round_trip(device: str) -> dict[str, Any]:
    """Blocks of a cache on ``device`` through the KV store's host staging (planned as
    for a sharded cache, so a CPU cache stages too) into another cache; ``passed``:
    they arrive bit-equal and nothing else is written."""
    import torch

    from tandem.engine.kv_shards import ShardedKVCache
    from tandem.kvstore.transfer_path import plan_kv_transfer

    src = torch.randn(64, 4, 2, 16, 2, 64, device=device, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    plan = plan_kv_transfer({torch.device(device).type}, False)
    ids = [3, 4, 5, 9, 40, 63]
    a, b = ShardedKVCache.from_tensor(src), ShardedKVCache.from_tensor(dst)
    buf = torch.empty((len(ids), *a.block_shape), dtype=src.dtype, pin_memory=plan.pinned)
    start = time.perf_counter()
    a.read_blocks(ids, buf)
    b.write_blocks(ids, buf)
    if src.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    ok = bool(torch.equal(dst[ids], src[ids])) and int(dst.count_nonzero()) == int(
        src[ids].count_nonzero())
    return {"passed": ok, "plan": {"path": plan.path.value, "pinned": plan.pinned,
                                   "reason": plan.reason},
            "num_blocks": len(ids), "block_bytes": a.block_bytes, "round_trip_s": elapsed}


def check_throughput(out_dir: Path) -> dict[str, Any]:
    """``tandem bench throughput`` against transformers on CUDA (bfloat16)."""
    path = out_dir / "throughput.json"
    script = Path(sys.executable).with_name("tandem")
    entry = [str(script)] if script.exists() else [sys.executable, "-m", "tandem.bench.main"]
    cmd = [*entry, *(["bench"] if script.exists() else []), "throughput", "--backend", "tandem",
           "--backend", "hf", "--device", DEVICE, "--dtype", "bfloat16",
           "--hf-batch-size", "64", "--json", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          check=False)
    (out_dir / "throughput.log").write_text(proc.stdout + proc.stderr)
    result: dict[str, Any] = {"passed": proc.returncode == 0, "command": " ".join(cmd)}
    if path.exists():
        doc = json.loads(path.read_text())
        result["results"] = {
            k: {"elapsed_s": v["elapsed_s"], "num_output_tokens": v["num_output_tokens"],
                "output_tokens_per_s": v["num_output_tokens"] / v["elapsed_s"]}
            for k, v in doc.get("results", {}).items()
            if "elapsed_s" in v and "num_output_tokens" in v}
        result["ratios"] = doc.get("ratios")
    return result


def check_parallel(out_dir: Path) -> dict[str, Any]:
    """bench/gpu_parallel.sh (TP and PP over two GPUs); skipped with fewer."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return {"passed": True, "skipped": f"{n} GPU (TP/PP needs 2)"}
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_parallel.sh", str(out_dir / "parallel"), "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
                          check=False)
    (out_dir / "parallel.log").write_text(proc.stdout + proc.stderr)
    report = out_dir / "parallel" / "gpu_parallel.json"
    return {"passed": proc.returncode == 0,
            "report": json.loads(report.read_text()) if report.exists() else None}


CHECKS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "kernels": check_kernels,
    "greedy": check_greedy,
    "kv_staging": check_kv_staging,
    "throughput": check_throughput,
    "parallel": check_parallel,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="build/gpu-check/report.json",
                   help="the JSON report's path (logs go beside it)")
    p.add_argument("--only", action="append", choices=sorted(CHECKS),
                   help="run this check only; repeat for several (default: all)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU here (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda}): nothing was run", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"environment": _environment(), "checks": {}}
    for name in args.only or list(CHECKS):
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            result = CHECKS[name](out.parent)
        except Exception as exc:  # noqa: BLE001 - recorded; the other checks still run
            result = {"passed": False, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
        result["elapsed_s"] = time.perf_counter() - start
        report["checks"][name] = result
        print(f"gpu-check: {name}: {'passed' if result['passed'] else 'FAILED'}",
              file=sys.stderr, flush=True)
        out.write_text(json.dumps(report, indent=2))  # partial results survive a crash
    report["passed"] = all(r["passed"] for r in report["checks"].values())
    out.write_text(json.dumps(report, indent=2))
    print(f"gpu-check: wrote {out}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
