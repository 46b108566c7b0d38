#!/usr/bin/env bash
# `make gpu-check` without installing anything: the GPU check (bench/gpu_check.py) with the
# Python it is given, importing `tandem` from this checkout. For a machine with no package
# registry (docs/deploy.md, "Check a GPU machine first"):
#   bash bench/gpu_check.sh [--out build/gpu-check/report.json] [--only CHECK ...]
#   PYTHON=/opt/torch/.venv/bin/python3 bash bench/gpu_check.sh
# PYTHON: the interpreter (default: this checkout's .venv when there is one, else python3);
# it needs torch, Triton, transformers, safetensors and pytest. `tandem` comes from a
# folder of links (bench/checkout_site.py) put on PYTHONPATH; the repository root never
# goes on sys.path (python -P): its kernels/ folder would shadow the `kernels`
# distribution that transformers imports. Exit status: 0 every check passed, 1 one did
# not, 2 no CUDA GPU (or no torch) here.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python; else py=python3; fi
fi
site=${TANDEM_CHECKOUT_SITE:-$root/build/gpu-check/site}
"$py" -P "$root/bench/checkout_site.py" "$site" >/dev/null
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
cd "$root"
exec "$py" -P -m tandem.bench.gpu_check "$@"
