"""Suite-wide set-up that must happen before torch is imported."""

from __future__ import annotations

import os

# The suite runs engines in-process next to service subprocesses on a few
# cores: the same OpenMP wait settings the service commands use (see
# tandem.cli.configure_openmp), before any test module imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
