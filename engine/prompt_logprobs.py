"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): per prompt token, its
logprob given the tokens before it and the top-k alternatives.

The model runner hands every step's hidden states here after the forward. For each
scheduled request that asks (and has produced no output yet, so a preempted request's
recompute does not repeat them), the rows of this step's chunk whose next token is
still a prompt token become float32 logits, then ``log_softmax``, then the next prompt
token's logprob and rank and the ``k`` most likely tokens. A prompt of ``P`` tokens has
``P - 1`` such positions; position 0 has no logprob (``None`` in the outputs). Requests
that do not ask cost one Python check per step.

The logprobs are of the raw model distribution (no temperature, penalties or bias), as
vLLM's default. Prefix-cache and KV-store hits are turned off for such requests
(``KVCacheManager.get_computed_blocks``, the admission's connector lookup), so every
prompt position is computed and has logits.
"""

from __future__ import annotations

import torch

from tandem.engine.models.interface import CausalLM
from tandem.engine.request import Logprob, PositionLogprobs, Request
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput

__all__ = ["PROMPT_LOGPROBS_ROWS", "prompt_logprobs_into", "wants_prompt_logprobs",
           "position_logprobs"]

#: rows turned into logits at once, so a long chunk never holds ``[chunk, vocab]`` floats
PROMPT_LOGPROBS_ROWS = 512


def wants_prompt_logprobs(req: Request) -> bool:
    """Whether ``req`` still needs prompt logprobs computed (asked, and no output yet)."""
    return req.sampling_params.prompt_logprobs is not None and not req.output_token_ids


def prompt_logprobs_into(
    model: CausalLM,
    hidden: torch.Tensor,
    sched: SchedulerOutput,
    out: ModelRunnerOutput,
) -> None:
    """Compute this step's prompt logprobs into ``out.prompt_logprobs``.

    Args:
        model: the model (its ``compute_logits``: under TP only the rank that gathers
            the logits writes).
        hidden: ``[num_tokens, hidden_size]`` hidden states of the step, request after
            request in ``sched.scheduled_requests`` order.
        sched: the step's batch; each request's chunk starts at its
            ``num_computed_tokens`` (not advanced yet).
        out: gets ``prompt_logprobs[request_id] = (start, positions)``: ``positions[i]``
            is the entry of prompt token ``start + 1 + i``.
    """
    offset = 0
    for req in sched.scheduled_requests:
        n = sched.num_scheduled_tokens[req.request_id]
        start = req.num_computed_tokens
        if wants_prompt_logprobs(req):
            # rows at positions start .. end-1 predict prompt tokens start+1 .. end
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > start:
                positions = _positions(model, hidden[offset : offset + end - start], req, start)
                if positions is not None:  # None: another TP rank holds the logits
                    out.prompt_logprobs[req.request_id] = (start, positions)
        offset += n


def _positions(
    model: CausalLM, rows: torch.Tensor, req: Request, start: int
) -> list[PositionLogprobs] | None:
    """Entries of prompt tokens ``start + 1 ..`` from their previous positions' hidden
    states ``rows`` (``[m, hidden_size]``), ``PROMPT_LOGPROBS_ROWS`` rows at a time;
    ``None`` on a TP rank that does not gather the logits (every rank still makes each
    ``compute_logits`` call: it is a collective)."""
    k = req.sampling_params.prompt_logprobs
    assert k is not None
    result: list[PositionLogprobs] = []
    for lo in range(0, rows.shape[0], PROMPT_LOGPROBS_ROWS):
        part = rows[lo : lo + PROMPT_LOGPROBS_ROWS]
        logits = model.compute_logits(part, upcast=True)
        if logits is None:
            continue
        targets = req.prompt_token_ids[start + 1 + lo : start + 1 + lo + part.shape[0]]
        result.extend(position_logprobs(logits, targets, k))
    return result if len(result) == rows.shape[0] else None


def position_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[PositionLogprobs]:
    """Per row of ``logits`` (``[m, vocab]``, any float dtype; computed in float32), the
    entry of token ``targets[row]``: its ``Logprob`` with rank first, then the ``k`` most
    likely tokens with ranks 1..k (vLLM's order; a target among them appears once)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logprobs.device).unsqueeze(1)
    target_lp = logprobs.gather(1, index)
    ranks = (logprobs > target_lp).sum(dim=1).add_(1).tolist()
    target_vals = target_lp.squeeze(1).tolist()
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    result: list[PositionLogprobs] = []
    for i, tok in enumerate(targets):
        entry: PositionLogprobs = {tok: Logprob(logprob=target_vals[i], rank=ranks[i])}
        if k > 0:
            for r, (v, t) in enumerate(zip(top_vals[i], top_ids[i], strict=True), start=1):
                if t not in entry:
                    entry[t] = Logprob(logprob=v, rank=r)
        result.append(entry)
    return result
