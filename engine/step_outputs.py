"""What a step's hidden states become: sampled tokens, verified drafts, next drafts.

The model runner calls these after the forward with the rows ``InputBatch`` selected
(engine/input_batch.py); each writes into the step's ``ModelRunnerOutput``.
"""

from __future__ import annotations

import torch

from tandem.engine.models.interface import CausalLM
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, is_plain_greedy
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.spec_decode.proposer import ProposeInput, Proposer
from tandem.engine.spec_decode.rejection_sampler import greedy_accept
from tandem.engine.spec_decode.verify import draft_positions, verify

__all__ = ["propose_into", "sample_into", "verify_into"]


def sample_into(
    model: CausalLM,
    sampler: Sampler,
    last: torch.Tensor,
    reqs: list[Request],
    sched: SchedulerOutput,
    out: ModelRunnerOutput,
) -> None:
    """Sample one token per request from ``last`` (``[len(reqs), hidden]``) into ``out``
    (its ``sampled_token_ids`` and ``logprobs``); under TP only the rank that gathers the
    logits writes."""
    if all(is_plain_greedy(r) for r in reqs):
        # Greedy without processors or logprobs: the head's argmax pass, no logits.
        ids = model.compute_greedy(last)
        if ids is not None:
            for req, token_id in zip(reqs, ids.tolist(), strict=True):
                out.sampled_token_ids[req.request_id] = token_id
            return
    logits = model.compute_logits(last, upcast=False)
    if logits is None:
        return  # another TP rank holds the gathered logits and samples
    results = sampler(logits, reqs, sched.grammar_bitmask)
    for req, (token_id, logprobs) in zip(reqs, results, strict=True):
        out.sampled_token_ids[req.request_id] = token_id
        if logprobs is not None:
            out.logprobs[req.request_id] = logprobs


def verify_into(
    model: CausalLM,
    sampler: Sampler,
    proposer: Proposer | None,
    rows: torch.Tensor,
    reqs: list[Request],
    sched: SchedulerOutput,
    out: ModelRunnerOutput,
) -> None:
    """Verify the draft tokens of ``reqs`` from the hidden states of their positions
    (``rows``: ``[sum(k_i + 1), hidden]``) with the rejection sampler."""
    drafts = [sched.scheduled_spec_token_ids[r.request_id] for r in reqs]
    positions = [p for r, d in zip(reqs, drafts, strict=True) for p in draft_positions(r, d)]
    if all(is_plain_greedy(p) for p in positions):
        ids = model.compute_greedy(rows)
        if ids is not None:
            argmax = ids.tolist()
            start = 0
            for req, d in zip(reqs, drafts, strict=True):
                out.verified_token_ids[req.request_id] = greedy_accept(
                    d, argmax[start : start + len(d) + 1]
                )
                start += len(d) + 1
            return
    logits = model.compute_logits(rows, upcast=False)
    assert logits is not None, "speculative decoding runs on one rank only"
    draft_probs = None
    if proposer is not None:
        draft_probs = [proposer.draft_probs(r.request_id, d)
                       for r, d in zip(reqs, drafts, strict=True)]
    results = verify(sampler, logits, reqs, drafts, sched.grammar_bitmask, draft_probs)
    for req, (tokens, logprobs) in zip(reqs, results, strict=True):
        out.verified_token_ids[req.request_id] = tokens
        if logprobs is not None:
            out.verified_logprobs[req.request_id] = logprobs


def propose_into(
    proposer: Proposer,
    sched: SchedulerOutput,
    out: ModelRunnerOutput,
    hidden: torch.Tensor,
    rows_of: dict[str, list[int]],
) -> None:
    """Draft tokens for the next step of the requests the scheduler gave a lookahead.

    ``rows_of``: request id -> the rows of ``hidden`` (``[num_tokens, hidden_size]``)
    at the positions that produced its tokens this step, for a proposer that takes
    the target's hidden states (empty otherwise)."""
    inputs: list[ProposeInput] = []
    by_id = {r.request_id: r for r in sched.scheduled_requests}
    for rid, k in sched.num_lookahead_tokens.items():
        new = out.verified_token_ids.get(rid)
        if new is None:
            token = out.sampled_token_ids.get(rid)
            if token is None:
                continue
            new = [token]
        states = None
        if rid in rows_of:
            # The positions whose outputs were emitted: one per new token.
            index = torch.tensor(rows_of[rid][: len(new)], device=hidden.device)
            states = hidden[index]
        inputs.append(ProposeInput(by_id[rid], new, k, sched.block_tables[rid], states))
    if not inputs:
        return
    for inp, drafts in zip(inputs, proposer.propose(inputs), strict=True):
        if drafts:
            out.draft_token_ids[inp.request.request_id] = drafts[: inp.max_num_tokens]
