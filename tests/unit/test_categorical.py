"""One draw per row from non-negative weights (engine/categorical.py): the draw follows
the weights, never picks a zero weight, and a seeded row's draw ignores the batch."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.categorical import BLOCK, draw_uniforms, sample_categorical


@pytest.mark.parametrize("vocab", [8, BLOCK, 3 * BLOCK + 77])
def test_draws_follow_the_weights_across_blocks(vocab: int) -> None:
    """Weights spread over several blocks (and a last, partial one): observed shares
    within 5 standard errors of the weights' over 200k draws; zero weights never."""
    w = torch.zeros(vocab)
    picks = sorted({0, 1, vocab // 2, vocab - 1})
    for j, i in enumerate(picks):
        w[i] = float(j + 1)
    n = 200_000
    g = torch.Generator().manual_seed(0)
    idx = sample_categorical(w.expand(n, -1), draw_uniforms([None] * n, g))
    counts = torch.bincount(idx, minlength=vocab)
    assert counts.sum() == n
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(picks)
    p = w / w.sum()
    for i in picks:
        se = (p[i] * (1 - p[i]) / n) ** 0.5
        assert abs(counts[i] / n - p[i]) < 5 * se, (i, counts[i] / n, p[i])


def test_a_uniform_next_to_one_never_picks_trailing_zero_weights() -> None:
    """u = 1 - 2^-53 times the total rounds up to the total; the point is kept below it,
    so the last positive weight is drawn, not a zero one after it (at both levels)."""
    vocab = 2 * BLOCK
    w = torch.zeros(1, vocab)
    w[0, 3] = 0.1
    w[0, BLOCK + 5] = 0.7  # last positive weight; every later one is 0
    top = torch.tensor([[1 - 2.0 ** -53, 1 - 2.0 ** -53]], dtype=torch.float64)
    assert sample_categorical(w, top).item() == BLOCK + 5
    zero = torch.zeros(1, 2, dtype=torch.float64)
    assert sample_categorical(w, zero).item() == 3


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_batch() -> None:
    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(1234)

    shared = torch.Generator().manual_seed(0)
    alone = draw_uniforms([seeded()], shared)
    in_batch = draw_uniforms([None, seeded(), None], shared)
    assert torch.equal(alone[0], in_batch[1])
    assert ((alone >= 0) & (alone < 1)).all()
    w = torch.rand(3, 1000)
    assert (sample_categorical(w[1:2], alone)[0]
            == sample_categorical(w, in_batch)[1])
