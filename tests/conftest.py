"""Suite-wide set-up that must happen before torch is imported."""

from __future__ import annotations

import os

# The suite runs engines in-process next to service subprocesses on a few
# cores: the same OpenMP wait settings the service commands use (see
# tandem.cli.configure_openmp), before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

# Helper processes started with `python -c` (multiprocessing's forkserver for the
# tensor-parallel ranks) would put the working directory first on sys.path; from the
# repository root its `kernels/` folder then shadows the `kernels` distribution that
# transformers imports. -P's effect, for every Python this suite starts.
os.environ.setdefault("PYTHONSAFEPATH", "1")
