"""tandem: disaggregated LLM serving (prefill and decode split, KV handed over a store).

The offline API is re-exported lazily so that ``import tandem`` stays cheap for
the router and CLI, which do not need torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# NOTE: OpenMP's default wait policy spins idle worker threads between parallel
# regions. When the host is oversubscribed (several services or jobs on a few
# cores) a spinning thread steals the core its peer needs, and each small torch
# op waits for a descheduled thread: measured on a loaded 2-vCPU host, a
# [64, 576] multiply took 3.2 ms instead of 0.03 ms and an engine decode step
# 5.3 s instead of 1.6 s. But going to sleep right away (PASSIVE alone) made
# every parallel region of a forward pass wake its peer through the kernel:
# on a quiet 2-core box the offline benchmark (64 x 256/128, bf16) ran 16.9 s
# instead of 12.9 s. So idle workers spin briefly (GOMP_SPINCOUNT spins, ~0.1
# ms; libgomp's unset default is 300000, ~3 ms) and then sleep: the gaps between
# a forward pass's ops are covered, an oversubscribed host loses little.
# Both must be set before torch (libgomp) loads, hence here; values already in
# the environment win.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tandem.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tandem.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
