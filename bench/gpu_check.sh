#!/usr/bin/env bash
# `make gpu-check` without installing anything: the GPU check (bench/gpu_check.py) with the
# Python it is given, importing `tandem` from this checkout. For a machine with no package
# registry (docs/deploy.md, "Check a GPU machine first"):
#   bash bench/gpu_check.sh [--out build/gpu-check/report.json] [--only CHECK ...]
#   PYTHON=/opt/torch/.venv/bin/python3 bash bench/gpu_check.sh
# PYTHON: the interpreter (default: this checkout's .venv when there is one, else python3);
# it needs torch, Triton, transformers, safetensors, psutil, numpy and pytest. `tandem`
# comes from the repository root, put on PYTHONPATH: the checkout's folders are linked
# under tandem/ and hold no __init__.py, so the root adds no package but `tandem` (its
# kernels/ folder never shadows the `kernels` distribution that transformers imports).
# Exit status: 0 every check passed, 1 one did not, 2 no CUDA GPU (or no torch) here.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-}
if [ -z "$py" ]; then
    if [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python; else py=python3; fi
fi
if ! command -v "$py" >/dev/null 2>&1; then
    echo "gpu-check: no Python at '$py' (set PYTHON=...); nothing was run" >&2
    exit 2
fi
case $py in */*) py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py") ;; esac  # before the cd
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1
cd "$root"
exec "$py" -P -m tandem.bench.gpu_check "$@"
