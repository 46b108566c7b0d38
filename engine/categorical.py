"""One draw per row from a categorical distribution given by non-negative weights.

Every random choice of the engine goes through here: the sampler's random rows, the
draft model's proposals and the rejection sampler's recovered / bonus token.

Algorithm: inverse-transform sampling in two levels. The vocabulary is cut into
blocks of :data:`BLOCK` entries; the block is chosen by the first uniform against the
cumulative block masses (summed and accumulated in float64, so a block's chance is
exact to float64 rounding), the entry inside it by the second uniform against the
block's own float32 cumulative sum (each entry's error is then relative to its
block's mass, not to the whole distribution's). A zero weight is never drawn: a
uniform ``u`` in ``[0, 1)`` maps to a point strictly below the total, and the search
takes the first cumulative sum strictly above that point.

Why not the exponential race (``argmax(w / E)``, ``E ~ Exp(1)``) used before: it needs
one exponential draw per vocabulary entry, and ``torch.Tensor.exponential_`` draws
them one at a time on the CPU (about 12 ms for 16 x 49152, most of a decode step of
the default model); this needs two uniforms per row. ``torch.multinomial`` was as slow
as the race on that shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

#: Entries per block of the first level.
BLOCK = 512


def draw_uniforms(generators: Sequence[torch.Generator | None],
                  shared: torch.Generator) -> torch.Tensor:
    """The two uniforms :func:`sample_categorical` takes for each row.

    Args:
        generators: per row, that row's own generator (a seeded request's), or ``None``
            for rows drawn from ``shared``.
        shared: the generator of the unseeded rows (one draw for all of them).

    Returns:
        ``[len(generators), 2]`` float64 in ``[0, 1)``. A seeded row's values depend
        only on its own generator's state, not on the batch.
    """
    u = torch.empty((len(generators), 2), dtype=torch.float64)
    if any(g is None for g in generators):
        u.uniform_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            u[i].uniform_(generator=g)
    return u


def sample_categorical(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one index per row with probability proportional to its weight.

    Args:
        weights: ``[num_rows, vocab]`` float32, non-negative, each row with a positive
            sum (unnormalised probabilities are fine); any device.
        uniforms: ``[num_rows, 2]`` float64 in ``[0, 1)`` (:func:`draw_uniforms`).

    Returns:
        ``[num_rows]`` int64 indices on ``weights``' device; an index whose weight is
        0 is never returned.
    """
    num_rows, vocab = weights.shape
    device = weights.device
    u = uniforms.to(device)
    num_blocks = -(-vocab // BLOCK)
    pad = num_blocks * BLOCK - vocab
    w = F.pad(weights, (0, pad)) if pad else weights
    blocks = w.reshape(num_rows, num_blocks, BLOCK)
    # float32 sums of BLOCK entries are exact to ~1e-7 of the block; accumulated in float64
    cum_mass = blocks.sum(dim=-1).double().cumsum(dim=-1)
    block = _search(cum_mass, u[:, :1])
    rows = torch.arange(num_rows, device=device)
    cum = blocks[rows, block].cumsum(dim=-1)  # [num_rows, BLOCK] float32
    inner = _search(cum, u[:, 1:].to(cum.dtype))
    return (block * BLOCK + inner).clamp_(max=vocab - 1)


def _search(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first position whose cumulative sum exceeds ``u`` times the row's
    total. ``cum``: ``[rows, n]``; ``u``: ``[rows, 1]`` of ``cum``'s dtype."""
    total = cum[:, -1:]
    # u * total can round up to total itself; the point must stay below it, or a run of
    # zero weights at the end of the row could be chosen
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, point, right=True).squeeze(1).clamp_(max=cum.shape[1] - 1)
