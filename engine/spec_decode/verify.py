"""Verifying draft tokens: the target's logits at every draft position -> emitted tokens.

A request with ``k`` draft tokens was fed its last known token and the drafts, so the
target scored ``k + 1`` positions in the step's one forward. Position ``j`` is the
distribution after the request's tokens plus the first ``j`` drafts: every sampling
rule (grammar mask, ``logit_bias``, ``min_tokens``, penalties, temperature, top-k/p,
min-p) is applied there as if those drafts were already output tokens
(:class:`DraftPosition`), with the sampler's own code, so ``p`` is exactly what
decoding without speculation would sample from. The rejection sampler then decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from tandem.engine.categorical import row_keys
from tandem.engine.request import PositionLogprobs, Request
from tandem.engine.sampler import Sampler, argmax_rows, gather_logprobs, is_plain_greedy
from tandem.engine.spec_decode.rejection_sampler import greedy_accept, rejection_sample

if TYPE_CHECKING:
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.structured_output.manager import StepBitmask

VerifyResult = tuple[list[int], list[PositionLogprobs] | None]


class DraftPosition:
    """A request as the sampler sees it at one draft position: its output extended by
    the drafts before that position (read-only, what the sampler reads of a ``Request``).
    """

    __slots__ = ("_req", "_drafts")

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self._req = request
        self._drafts = drafts

    @property
    def request_id(self) -> str:
        return self._req.request_id

    @property
    def sampling_params(self) -> SamplingParams:
        return self._req.sampling_params

    @property
    def eos_token_id(self) -> int | None:
        return self._req.eos_token_id

    @property
    def generator(self) -> torch.Generator | None:
        return self._req.generator

    @property
    def num_output_tokens(self) -> int:
        return self._req.num_output_tokens + len(self._drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self._req.output_token_ids + self._drafts

    @property
    def all_token_ids(self) -> list[int]:
        return self._req.all_token_ids + self._drafts


def draft_positions(request: Request, drafts: list[int]) -> list[Request]:
    """The ``len(drafts) + 1`` positions of a verified request, as sampler rows."""
    return [cast("Request", DraftPosition(request, drafts[:j])) for j in range(len(drafts) + 1)]


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: Sequence[Request],
    drafts: Sequence[list[int]],
    grammar_bitmask: StepBitmask | None = None,
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> list[VerifyResult]:
    """The tokens each verified request emits this step.

    Args:
        logits: ``[sum(len(d) + 1 for d in drafts), vocab]`` target logits (model dtype
            or float32, any device): request ``i``'s ``len(drafts[i]) + 1`` positions in
            order, requests in order. Modified in place when float32.
        requests / drafts: the verified requests and their draft tokens (>= 1 each).
        grammar_bitmask: the step's bitmask; ``spec_rows[request_id]`` gives a
            constrained request's row at each of its positions.
        draft_probs: per request, the ``[len(drafts[i]), vocab]`` float32 distributions
            its drafts were drawn from (a draft model's, for a random request), or
            ``None`` (or no list at all) for point masses.

    Returns:
        Per request: the emitted tokens (accepted drafts, then the target's recovered
        or bonus token) and, when the request asks for logprobs, their logprobs.
    """
    rows: list[Request] = []
    starts: list[int] = []
    for req, d in zip(requests, drafts, strict=True):
        assert d, f"{req.request_id}: verification without draft tokens"
        starts.append(len(rows))
        rows.extend(draft_positions(req, d))
    assert logits.shape[0] == len(rows), f"{logits.shape[0]} logits rows for {len(rows)} positions"
    if all(is_plain_greedy(r) for r in rows):
        plain = argmax_rows(logits).tolist()
        return [
            (greedy_accept(d, plain[s : s + len(d) + 1]), None)
            for s, d in zip(starts, drafts, strict=True)
        ]
    bitmask, mask_rows = _mask_rows(grammar_bitmask, requests, drafts)
    processed = sampler.process_logits(logits, rows, bitmask, mask_rows)

    emitted: list[list[int]] = [[] for _ in requests]
    argmax: list[int] | None = None
    random_idx: list[int] = []
    for i, req in enumerate(requests):
        if req.sampling_params.greedy:
            if argmax is None:
                argmax = argmax_rows(processed).tolist()
            s = starts[i]
            emitted[i] = greedy_accept(drafts[i], argmax[s : s + len(drafts[i]) + 1])
        else:
            random_idx.append(i)
    if random_idx:
        sampled = _sample_random(sampler, processed, rows, starts, random_idx, requests,
                                 drafts, draft_probs)
        for i, toks in zip(random_idx, sampled, strict=True):
            emitted[i] = toks
    return [_with_logprobs(processed, req, starts[i], emitted[i])
            for i, req in enumerate(requests)]


def _mask_rows(grammar_bitmask: StepBitmask | None, requests: Sequence[Request],
               drafts: Sequence[list[int]]
               ) -> tuple[torch.Tensor | None, list[int | None] | None]:
    """The step's grammar bitmask and, per verified position, its row in it (``None``:
    an unconstrained request's position); ``(None, None)`` without a bitmask."""
    if grammar_bitmask is None:
        return None, None
    mask_rows: list[int | None] = []
    for req, d in zip(requests, drafts, strict=True):
        spec = grammar_bitmask.spec_rows.get(req.request_id)
        mask_rows.extend(spec if spec is not None else [None] * (len(d) + 1))
    return grammar_bitmask.bitmask, mask_rows


def _sample_random(sampler: Sampler, processed: torch.Tensor, rows: list[Request],
                   starts: list[int], random_idx: list[int], requests: Sequence[Request],
                   drafts: Sequence[list[int]],
                   draft_probs: Sequence[torch.Tensor | None] | None) -> list[list[int]]:
    """Rejection-sample the random requests ``random_idx`` (indices into ``requests``):
    their target distributions at every position (``processed`` rows from ``starts``),
    padded to the longest draft, and their drafts' proposal distributions (point masses
    where a request has none). Returns each one's emitted tokens, in order."""
    k_max = max(len(drafts[i]) for i in random_idx)
    vocab = processed.shape[1]
    device = processed.device
    target = torch.zeros((len(random_idx), k_max + 1, vocab), dtype=torch.float32,
                         device=device)
    padded = torch.zeros((len(random_idx), k_max), dtype=torch.int64)
    qs = [draft_probs[i] if draft_probs is not None else None for i in random_idx]
    q_all = None
    if any(q is not None for q in qs):
        # Rows without a q get their point mass: one batch, one rule.
        q_all = torch.zeros((len(random_idx), k_max, vocab), dtype=torch.float32,
                            device=device)
    # One pass over every random row (per-call overhead dominates at these sizes).
    sel = [j for i in random_idx for j in range(starts[i], starts[i] + len(drafts[i]) + 1)]
    probs = sampler.target_probs(processed[sel], [rows[j] for j in sel])
    at = 0
    for b, i in enumerate(random_idx):
        n = len(drafts[i]) + 1
        target[b, :n] = probs[at : at + n]
        at += n
        padded[b, : n - 1] = torch.tensor(drafts[i], dtype=torch.int64)
        if q_all is not None:
            q = qs[b]
            if q is None:
                q_all[b, torch.arange(n - 1), padded[b, : n - 1].to(q_all.device)] = 1.0
            else:
                q_all[b, : n - 1] = q
    return rejection_sample(
        padded,
        [len(drafts[i]) for i in random_idx],
        target,
        q_all,
        # seeded rows: their draws for this step keyed by the position it starts at
        [requests[i].step_generator() for i in random_idx],
        sampler.generator,
        row_keys([requests[i].step_seed() for i in random_idx], sampler.noise_generator),
    )


def _with_logprobs(processed: torch.Tensor, req: Request, start: int, toks: list[int]
                   ) -> VerifyResult:
    """``toks`` with their logprobs from ``processed`` rows ``start ..`` when ``req``
    asks for logprobs (temperature applied for a random request), else ``None``."""
    params = req.sampling_params
    if params.logprobs is None:
        return toks, None
    lp_rows = processed[start : start + len(toks)]
    if not params.greedy:
        lp_rows = lp_rows / params.temperature
    lps = gather_logprobs(lp_rows, toks, [params] * len(toks))
    return toks, [lp for _, lp in lps if lp is not None]
