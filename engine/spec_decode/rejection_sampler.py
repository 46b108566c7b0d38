"""Rejection sampling of draft tokens: the output keeps the target's distribution exactly.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling"): draft token ``d_j`` drawn from ``q_j`` is accepted with
probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn
from the normalised ``max(0, p_j - q_j)`` and the rest of the draft is dropped; when
every draft token was accepted one bonus token is drawn from ``p_k``. Each emitted
token is then distributed as ``p`` given its prefix. A proposer that picks its tokens
deterministically (n-gram lookup, a draft model's argmax) has the point mass ``q_j =
onehot(d_j)``: ``d_j`` is accepted with probability ``p_j(d_j)``, and the residual is
``p_j`` without ``d_j``.

Greedy requests (temperature 0) need no draws: the longest prefix of the draft equal to
the target's argmax is accepted, then the argmax at the first mismatch (or after the
last draft token) is emitted, which is exactly what decoding without speculation gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.categorical import sample_race


def greedy_accept(draft_token_ids: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Tokens a greedy request emits: the draft's longest prefix equal to the target's
    argmax, then the argmax at the next position.

    Args:
        draft_token_ids: ``k`` draft tokens.
        target_argmax: ``k + 1`` argmax tokens, at the positions that follow the
            request's last known token and each draft token.

    Returns:
        1 to ``k + 1`` tokens.
    """
    assert len(target_argmax) == len(draft_token_ids) + 1, (
        f"{len(target_argmax)} target positions for {len(draft_token_ids)} draft tokens"
    )
    out: list[int] = []
    for d, t in zip(draft_token_ids, target_argmax, strict=False):
        out.append(t)
        if d != t:
            return out
    out.append(target_argmax[-1])
    return out


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: Sequence[torch.Generator | None],
    generator: torch.Generator,
    final_keys: torch.Tensor,
) -> list[list[int]]:
    """Accept or reject the draft tokens of random-sampling requests.

    Args:
        draft_token_ids: ``[B, K]`` int64; row ``b`` holds its ``num_draft_tokens[b]``
            draft tokens first (the rest is padding, any valid token id).
        num_draft_tokens: ``B`` counts in ``1..K``.
        target_probs: ``[B, K + 1, V]`` float32 target probabilities (each row sums to 1
            over the vocabulary; truncation, penalties, masks already applied): position
            ``j`` is the distribution of the token after the ``j``-th draft token (0:
            after the request's last known token). Rows past ``num_draft_tokens[b] + 1``
            are ignored.
        draft_probs: ``[B, K, V]`` float32 proposal distributions the drafts were drawn
            from, or ``None`` for point masses (deterministic proposers).
        generators: per row, the request's own generator (seeded requests) or ``None``:
            the acceptance uniforms.
        generator: the acceptance uniforms of the unseeded rows.
        final_keys: ``[B]`` int64, each row's race key for its final token
            (``categorical.row_keys``: a seeded row's from its seed).

    Returns:
        Per row, the emitted tokens: the accepted drafts, then one recovered or bonus
        token (``1 .. num_draft_tokens[b] + 1`` tokens).

    Draws per row: ``K`` uniforms (a seeded row's from its own generator, so its output
    does not depend on the batch), then the final token by the exponential race of its
    key (engine/categorical.py).
    """
    num_rows, k_max = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    assert target_probs.shape == (num_rows, k_max + 1, vocab), (
        f"target_probs {tuple(target_probs.shape)} for drafts {tuple(draft_token_ids.shape)}"
    )
    assert len(num_draft_tokens) == num_rows and len(generators) == num_rows
    device = target_probs.device
    drafts = draft_token_ids.to(device)
    uniform = _acceptance_uniforms(num_rows, k_max, generators, generator).to(device)
    num_draft = torch.tensor(list(num_draft_tokens), dtype=torch.int64, device=device)
    valid = torch.arange(k_max, device=device).unsqueeze(0) < num_draft.unsqueeze(1)
    p_draft = target_probs[:, :k_max].gather(2, drafts.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        accepted = uniform < p_draft
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
        # u < min(1, p / q) written without the division (q > 0 where d was drawn).
        accepted = uniform * q_draft < p_draft
    accepted &= valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # leading run
    final_dist = _final_distribution(drafts, num_accepted, num_draft, target_probs,
                                     draft_probs)
    final = sample_race(final_dist, final_keys)

    out: list[list[int]] = []
    drafts_list = draft_token_ids.tolist()
    for b, (n, t) in enumerate(zip(num_accepted.tolist(), final.tolist(), strict=True)):
        out.append(drafts_list[b][:n] + [t])
    return out


def _acceptance_uniforms(num_rows: int, k_max: int,
                         generators: Sequence[torch.Generator | None],
                         generator: torch.Generator) -> torch.Tensor:
    """``[num_rows, k_max]`` float32 uniforms on the CPU: a seeded row's from its own
    generator (its output then does not depend on the batch), the others' from
    ``generator``."""
    uniform = torch.empty((num_rows, k_max), dtype=torch.float32)
    if any(g is None for g in generators):
        uniform.uniform_(generator=generator)
    for b, g in enumerate(generators):
        if g is not None:
            uniform[b].uniform_(generator=g)
    return uniform


def _final_distribution(drafts: torch.Tensor, num_accepted: torch.Tensor,
                        num_draft: torch.Tensor, target_probs: torch.Tensor,
                        draft_probs: torch.Tensor | None) -> torch.Tensor:
    """``[B, V]`` float32: per row, the distribution of the token after its accepted
    drafts: the target's at that position when every draft was accepted (the bonus
    token), else the residual ``max(0, p - q)`` at the first rejection (normalized by
    the sampler; ``q`` a point mass on the draft for deterministic proposers)."""
    num_rows, k_max = drafts.shape
    rows = torch.arange(num_rows, device=drafts.device)
    p_final = target_probs[rows, num_accepted]
    at = num_accepted.clamp(max=k_max - 1)
    if draft_probs is None:
        q_final = torch.zeros_like(p_final)
        q_final[rows, drafts[rows, at]] = 1.0
    else:
        q_final = draft_probs[rows, at]
    residual = (p_final - q_final).clamp_(min=0.0)
    # NOTE: a residual of all zeros means p == q, where rejection has probability 0;
    # only rounding gets there, and p itself is then the right distribution.
    empty = residual.sum(dim=1, keepdim=True) <= 0.0
    residual = torch.where(empty, p_final, residual)
    is_bonus = (num_accepted >= num_draft).unsqueeze(1)
    return torch.where(is_bonus, p_final, residual)
