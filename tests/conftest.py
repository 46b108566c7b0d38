"""Suite-wide set-up that must happen before torch is imported."""

from __future__ import annotations

import os

# The suite runs engines in-process next to service subprocesses on a few
# cores: the same OpenMP wait settings the service commands use (see
# tandem.cli.configure_openmp), before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# Triton decorates its own library functions when first imported, in the mode
# TRITON_INTERPRET says then: set it before any test module (or transformers, which may
# import triton) does, so the kernel tests run under the interpreter in this process
# instead of a later module finding a native-mode triton already loaded. Not for the GPU
# check, which runs the kernel tests natively (TANDEM_TEST_DEVICE=cuda).
if os.environ.get("TANDEM_TEST_DEVICE") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")
