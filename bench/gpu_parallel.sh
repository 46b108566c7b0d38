#!/usr/bin/env bash
# Tensor/pipeline parallelism on a machine with N >= 2 CUDA GPUs (issue 18's GPU check).
# Not run in CI (no GPU there). Usage, from the repository root with tandem installed:
#   bench/gpu_parallel.sh OUT_DIR [N]        (N: the tensor-parallel size; default 2)
# For each case, greedy tokens (float32, EOS ignored) of LLM(device="cuda") at
# TP x PP are compared with one in-process engine on cuda:0, and both engines are
# timed on the same batch (one pass each, sequentially: the in-process engine is shut
# down first). Cases: random-weight models of SmolLM2-135M's size (bench/make_tp_model.py;
# no GGUF, which a bare GPU box lacks): its own 9 heads / 3 KV heads at PP=N, and 12
# heads / 4 KV heads at TP=N. Writes OUT_DIR/gpu_parallel.json; exits 1 when a case's
# tokens differ in more than a tenth of the requests (near-ties under another reduction
# order are counted).
set -euo pipefail
out=${1:?usage: bench/gpu_parallel.sh OUT_DIR [N]}
n=${2:-2}
py=${PYTHON:-python}
# -P (and PYTHONSAFEPATH for the worker processes): the working directory never goes on
# sys.path, where the repository root's kernels/ folder would shadow the `kernels`
# distribution that transformers imports.
export PYTHONSAFEPATH=1
mkdir -p "$out"
"$py" -P -m tandem.bench.make_tp_model "$out/tp-model"
"$py" -P -m tandem.bench.make_tp_model "$out/pp-model" --heads 9 --kv-heads 3
"$py" -P - "$out" "$n" <<'EOF'
import json, shutil, subprocess, sys, time
import torch
from tandem import LLM, SamplingParams

NUM, IN, NEW = 64, 256, 64
# 4 GiB of KV cache each: both engines must fit beside each other's leftovers on cuda:0.
KV = 4 << 30

def run(model, tp, pp):
    kw = dict(model=model, dtype="float32", device="cuda", kv_cache_memory=KV,
              max_model_len=IN + NEW + 16, tensor_parallel_size=tp,
              pipeline_parallel_size=pp)
    with LLM(**kw) as llm:
        vocab = 49152
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1000, vocab, (NUM, IN), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        warm = SamplingParams(temperature=0.0, max_tokens=4)
        llm.generate([prompts[0][:16]], warm, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        core = llm.llm_engine.engine_core
        stats = core.executor.collective_stats() if tp * pp > 1 else []
        steps = core.num_steps
    torch.cuda.empty_cache()
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return toks, {"output_tokens_per_s": NUM * NEW / elapsed, "elapsed_s": elapsed,
                  "num_steps": steps, "collectives": stats}

def main():
    out, n = sys.argv[1], int(sys.argv[2])
    assert torch.cuda.device_count() >= n, f"needs {n} CUDA devices"
    cases = [("pp-model", f"{out}/pp-model", 1, n), ("tp-model", f"{out}/tp-model", n, 1)]
    report = {"gpus": [torch.cuda.get_device_name(i) for i in range(n)],
              "torch": torch.__version__, "num_prompts": NUM, "input_len": IN,
              "output_len": NEW, "cases": {}}
    ok = True
    for name, model, tp, pp in cases:
        ref, one = run(model, 1, 1)
        got, par = run(model, tp, pp)
        diff = sum(a != b for a, b in zip(ref, got, strict=True))
        ok &= diff <= NUM // 10
        report["cases"][name] = {
            "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "tp1": one, "par": par,
            "ratio": par["output_tokens_per_s"] / one["output_tokens_per_s"],
            "requests_with_other_tokens": diff}
        print(f"{name}: TP={tp} PP={pp} {report['cases'][name]['ratio']:.2f}x of TP=1, "
              f"{diff}/{NUM} requests with other tokens", flush=True)
    smi = shutil.which("nvidia-smi")  # torch found the GPUs; nvidia-smi may be missing
    try:  # or hang, or fail: the report is written regardless
        report["nvidia_smi"] = (subprocess.run([smi, "-L"], capture_output=True, text=True,
                                               timeout=15).stdout if smi else None)
    except (OSError, subprocess.SubprocessError):
        report["nvidia_smi"] = None
    with open(f"{out}/gpu_parallel.json", "w") as f:
        json.dump(report, f, indent=2)
    sys.exit(0 if ok else 1)


# the guard: spawned workers import __main__ when it is a file
if __name__ == "__main__":
    main()
EOF
