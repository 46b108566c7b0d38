"""Applying a step's grammar bitmask to the logits: step 0 of the sampler.

Bitmask layout (xgrammar's): ``int32 [num_mask_rows, ceil(vocab' / 32)]``, ``vocab'`` the
grammar's vocabulary; bit ``j % 32`` of word ``j // 32`` of a row is 1 when token ``j`` is
allowed. Bit 31 is the sign bit, so a word whose token ``32 * w + 31`` is allowed is a
negative int32. ``StructuredOutputManager`` fills a step's rows (``StepBitmask``: one per
constrained request, one per verified position under speculative decoding); the logits are
``[num_reqs, vocab]`` float32, and ``rows`` / ``mask_rows`` pair each masked logits row
with its bitmask row.

:func:`apply_token_bitmask` is the engine's path (xgrammar's kernel, behind
``backend.apply_token_bitmask``, which takes a bitmask already row-aligned with the
logits); :func:`apply_token_bitmask_ref` is the torch reference, the oracle the tests hold
it to.
"""

from __future__ import annotations

import torch


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], mask_rows: list[int]
) -> None:
    """Set the logits of disallowed tokens to -inf, in place, with xgrammar's kernel
    (``structured_output.backend.apply_token_bitmask``; much faster than
    :func:`apply_token_bitmask_ref` on the CPU, see docs/benchmarks.md). Same arguments
    and, where the bitmask covers the logits' width (the engine's always does), the same
    result as the reference, which the tests hold it to.
    """
    # NOTE: a lazy import: only steps with constrained requests load xgrammar.
    from tandem.engine.structured_output.backend import apply_token_bitmask as apply_kernel

    aligned = torch.full(
        (logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device
    )
    aligned[rows] = bitmask[mask_rows]
    apply_kernel(logits, aligned, rows)


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], mask_rows: list[int]
) -> None:
    """Set the logits of disallowed tokens to -inf, in place (the torch reference).

    Args:
        logits: ``[num_reqs, vocab]`` float32 (any device).
        bitmask: ``int32 [num_mask_rows, ceil(vocab' / 32)]``, xgrammar's layout: bit
            ``j % 32`` of word ``j // 32`` is 1 when token ``j`` is allowed. Tokens past
            the bitmask's width (logits wider than the grammar's vocabulary) are
            disallowed.
        rows: logits rows to mask; ``mask_rows[i]`` is the bitmask row of ``rows[i]``.
    """
    num_rows, vocab = logits.shape[0], logits.shape[1]
    assert max(rows) < num_rows, f"row {max(rows)} outside {num_rows} logits rows"
    words = bitmask[mask_rows].to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # NOTE: `>>` of a negative int32 is arithmetic; `& 1` still isolates the bit.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1).bool()
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        pad = torch.zeros(
            (len(rows), vocab - allowed.shape[1]), dtype=torch.bool, device=logits.device
        )
        allowed = torch.cat([allowed, pad], dim=1)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
