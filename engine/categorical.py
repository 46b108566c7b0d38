"""One draw per row from a categorical distribution by the exponential race.

With ``E_i ~ Exp(1)`` i.i.d., ``argmax_i(w_i / E_i)`` is index ``i`` with probability
``w_i / sum(w)`` (the Gumbel-max trick in another form). The sampler's random rows
draw this way. A small change of the weights (a KV cache recomputed after a migration,
another kernel's rounding) moves the winner only when two candidates nearly tie, so a
seeded request keeps its tokens across such paths; inverse-transform sampling, tried
instead, changed the token whenever the uniform fell within the cumulative rounding
of a boundary (14 of 2,000 seeded draws at a 1e-4 relative logit change against none for
the race; docs/benchmarks.md).

The noise comes from NumPy's PCG64 generators, not ``torch.Tensor.exponential_``: the
race needs one Exp(1) per vocabulary entry, and torch draws them one at a time on the
CPU (12.3 ms for 16 x 49152 on the AMX box against 2.5 ms for NumPy's ziggurat).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def exponential_noise(row_seeds: Sequence[int | None], vocab: int,
                      shared: np.random.Generator) -> torch.Tensor:
    """Exp(1) noise for the race, one row per entry of ``row_seeds``.

    Args:
        row_seeds: per row, a seed (a seeded request's for this output position: its
            row depends on nothing else) or ``None`` (drawn from ``shared``).
        vocab: entries per row.
        shared: the generator of the unseeded rows.

    Returns:
        ``[len(row_seeds), vocab]`` float32, CPU, every value > 0.
    """
    out = np.empty((len(row_seeds), vocab), dtype=np.float32)
    if all(s is None for s in row_seeds):
        shared.standard_exponential(out=out, dtype=np.float32)
    else:
        for i, s in enumerate(row_seeds):
            gen = shared if s is None else np.random.Generator(np.random.PCG64(s))
            gen.standard_exponential(out=out[i], dtype=np.float32)
    noise = torch.from_numpy(out)
    # NOTE: Exp(1) may return 0.0 exactly; a zero would make w / E inf or nan.
    return noise.clamp_(min=1e-20)


def sample_race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``argmax(weights / noise)`` per row: a draw proportional to the weights.

    Args:
        weights: ``[num_rows, vocab]`` float32, non-negative (probabilities or
            unnormalised); modified in place.
        noise: ``[num_rows, vocab]`` float32 Exp(1) draws (:func:`exponential_noise`).

    Returns:
        ``[num_rows]`` int64 indices on ``weights``' device; a zero weight is never
        returned unless the whole row is zero.
    """
    return weights.div_(noise.to(weights.device)).argmax(dim=-1)
