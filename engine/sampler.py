"""Token sampling for one engine step: logits processors, then greedy or random choice.

Order of operations (vLLM v1's order, so results match what its users expect):

0. the grammar bitmask of constrained requests (structured outputs,
   :mod:`tandem.engine.structured_output.bitmask`): tokens the request's grammar does
   not allow next are set to -inf, so every later rule, the logprobs included, sees
   only allowed tokens;
1. ``logit_bias`` (additive) and ``min_tokens`` (EOS and ``stop_token_ids`` set to
   -inf while fewer than ``min_tokens`` tokens were generated);
2. penalties: repetition (CTRL rule, Keskar et al. 2019, over prompt + output
   tokens: a positive logit is divided by the penalty, a negative one multiplied),
   then frequency and presence (OpenAI rule, over output tokens:
   ``logit -= frequency * count + presence * (count > 0)``);
3. greedy rows (temperature 0) take ``argmax`` here: on unprocessed float32 logits
   this is exactly transformers' ``generate(do_sample=False)``;
4. random rows: divide by temperature, then ``min_p``, ``top_k`` and ``top_p``
   truncation, then the exponential race (:mod:`tandem.engine.categorical`): with
   ``q ~ Exp(1)`` i.i.d., ``argmax(p / q)`` is a sample from ``p``. ``q`` is a
   counter-based stream (Philox4x32-10) of the row's key: for a seeded request the
   key of its seed and output position (``Request.step_seed``), so its tokens depend
   neither on what else is in the batch nor on which engine sampled the earlier
   positions; an unseeded row's key comes from the sampler's own key stream.
   A row that samples with its temperature alone (:func:`is_temperature_only`) skips
   the division and the softmax: :func:`~tandem.engine.categorical.sample_race_logits`
   races ``exp((logit - max) / T)``, the same draw up to a float near-tie, and where no
   processor touched any row it reads the model's logits as they are (bf16 too).

Logprobs are vLLM's "processed" kind: ``log_softmax`` of the logits after steps 1-2
and the temperature division (for temperature > 0), before top-k / top-p / min_p
truncation, so every returned value is finite unless a token was masked in step 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tandem.engine.categorical import (
    SAMPLER_STREAM,
    key_generator,
    row_keys,
    sample_race,
    sample_race_logits,
)
from tandem.engine.request import Logprob, PositionLogprobs, Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output.bitmask import apply_token_bitmask
from tandem.kernels import cpu_ext

if TYPE_CHECKING:
    from tandem.engine.structured_output.manager import StepBitmask

SampleResult = tuple[int, PositionLogprobs | None]
_FLOAT32_MAX = torch.finfo(torch.float32).max


class Sampler:
    """Samples one token per request from a batch of logits.

    Args:
        seed: seed of the global generator used by unseeded random requests.
    """

    def __init__(self, seed: int = 0) -> None:
        #: unseeded rows' draws of speculative verification (rejection_sampler)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        #: unseeded rows' race keys (engine/categorical.py)
        self.noise_generator = key_generator(seed, SAMPLER_STREAM)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        grammar_bitmask: StepBitmask | None = None,
    ) -> list[SampleResult]:
        """Pick the next token of every request.

        Args:
            logits: ``[num_reqs, vocab_size]`` float32 or the model's dtype (any
                device), row i belongs to ``requests[i]``. Modified in place
                when float32 (other dtypes are widened to a float32 copy first,
                except where every row is plain greedy or an unprocessed
                :func:`is_temperature_only` row).
            requests: requests in batch order; ``output_token_ids`` holds the tokens
                generated before this step.
            grammar_bitmask: allowed tokens of the constrained requests (their rows by
                request id), applied before everything else; ``None``: none constrained.

        Returns:
            ``(token_id, logprobs)`` per request, in order; ``logprobs`` is ``None``
            unless the request asked for them (``SamplingParams.logprobs``).

        Raises:
            AssertionError: when ``logits`` and ``requests`` disagree in length.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (
            f"logits {tuple(logits.shape)} vs {len(requests)} requests"
        )
        if all(is_plain_greedy(r) for r in requests):
            # No processor touches these rows and nobody wants logprobs: the argmax of
            # the logits in their own dtype is the token (widening bf16 to float32 is
            # exact, so the float32 path would pick the same index), and the
            # [num_reqs, vocab] float32 copy is skipped.
            return [(t, None) for t in argmax_rows(logits).tolist()]
        params = [r.sampling_params for r in requests]
        fused = [is_temperature_only(p) for p in params]
        if not all(is_plain_greedy(r) or (f and is_unprocessed(r))
                   for r, f in zip(requests, fused, strict=True)):
            mask_rows = None
            if grammar_bitmask is not None:
                mask_rows = [grammar_bitmask.rows.get(r.request_id) for r in requests]
            logits = self.process_logits(
                logits, requests, grammar_bitmask.bitmask if grammar_bitmask else None, mask_rows
            )
        # else: no processor touches a row, and both the argmax and the fused race read
        # the model's dtype: no float32 copy.
        num_rows = len(requests)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        fused_rows = [i for i, f in enumerate(fused) if f]
        truncated_rows = [i for i, (p, f) in enumerate(zip(params, fused, strict=True))
                          if not (p.greedy or f)]
        keys = None
        if len(greedy_rows) < num_rows:
            # one key per row, greedy rows included, in row order: an unseeded row's key
            # does not depend on which path draws it
            seeds = [None if p.greedy else r.step_seed()
                     for r, p in zip(requests, params, strict=True)]
            keys = row_keys(seeds, self.noise_generator)
        ids = [0] * num_rows
        if greedy_rows:
            _scatter(ids, greedy_rows, argmax_rows(_take(logits, greedy_rows)))
        if fused_rows:
            assert keys is not None
            temps = torch.tensor([params[i].temperature for i in fused_rows], dtype=torch.float32)
            _scatter(ids, fused_rows, sample_race_logits(
                _take(logits, fused_rows), temps, _take(keys, fused_rows)))
        want_logprobs = any(p.logprobs is not None for p in params)
        if truncated_rows:
            assert keys is not None
            _scatter(ids, truncated_rows, self._sample_truncated(
                logits, truncated_rows, params, _take(keys, truncated_rows), want_logprobs))
        if not want_logprobs:
            return [(t, None) for t in ids]
        # greedy rows' logits are their processed logits (temperature 1); the truncated
        # rows were divided in place above; fused rows never want logprobs
        return gather_logprobs(logits, ids, params)

    @staticmethod
    def process_logits(
        logits: torch.Tensor,
        requests: Sequence[Request],
        bitmask: torch.Tensor | None = None,
        mask_rows: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """Steps 0-2 of the module docstring: grammar mask, ``logit_bias`` and
        ``min_tokens``, penalties.

        Args:
            logits: ``[num_reqs, vocab]`` (any float dtype); modified in place when float32.
            requests: row ``i``'s request (its output so far defines penalties and
                ``min_tokens``).
            bitmask / mask_rows: the step's grammar bitmask and, per logits row, its
                bitmask row (``None``: unconstrained).

        Returns:
            ``[num_reqs, vocab]`` float32 processed logits (``logits`` itself if float32).
        """
        if logits.dtype != torch.float32:
            logits = logits.float()
        if bitmask is not None and mask_rows is not None:
            pairs = [(i, m) for i, m in enumerate(mask_rows) if m is not None]
            if pairs:
                apply_token_bitmask(
                    logits, bitmask, [i for i, _ in pairs], [m for _, m in pairs]
                )
        _apply_bias_and_min_tokens(logits, requests)
        _apply_penalties(logits, requests)
        return logits

    @staticmethod
    def target_probs(processed: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The distribution a random request samples from (step 4 without the draw):
        temperature, top-k / top-p, softmax, min-p, renormalised.

        Args:
            processed: ``[num_reqs, vocab]`` float32 from :meth:`process_logits`; not
                modified. Every row's request must sample (temperature > 0).

        Returns:
            ``[num_reqs, vocab]`` float32, each row summing to 1.
        """
        params = [r.sampling_params for r in requests]
        assert not any(p.greedy for p in params), "target_probs of a greedy request"
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        work = processed / temps.to(processed.device).unsqueeze(1)
        greedy = [False] * len(params)
        _apply_top_k_top_p(work, params, greedy)
        probs = torch.softmax(work, dim=-1)
        _apply_min_p(probs, params, greedy)
        return probs.div_(probs.sum(dim=-1, keepdim=True))

    @staticmethod
    def _sample_truncated(
        logits: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        keys: torch.Tensor,
        keep_processed: bool,
    ) -> torch.Tensor:
        """Step 4 for random rows that truncate (or want logprobs): divide by the
        temperature, apply min_p, top_k and top_p, draw by the exponential race over the
        probabilities.

        Args:
            logits: ``[num_reqs, vocab]`` float32 processed logits.
            rows: the rows of ``logits`` to draw (non-greedy); ``params``: every row's.
            keys: ``[len(rows)]`` int64 race keys of those rows.
            keep_processed: write the rows divided by their temperature back into
                ``logits`` (the processed logprobs read them); else ``logits`` is not
                modified.

        Returns:
            ``[len(rows)]`` int64 token ids.
        """
        temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
        work = _take(logits, rows) / temps.to(logits.device).unsqueeze(1)
        if keep_processed:
            logits[rows] = work
        sub = [params[i] for i in rows]
        no_greedy = [False] * len(rows)
        _apply_top_k_top_p(work, sub, no_greedy)
        probs = torch.softmax(work, dim=-1)
        _apply_min_p(probs, sub, no_greedy)
        return sample_race(probs, keys)


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of ``t``: ``t`` itself (no copy) when they are all of its rows in order."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def _scatter(ids: list[int], rows: list[int], tokens: torch.Tensor) -> None:
    """``ids[rows[j]] = tokens[j]``."""
    for i, t in zip(rows, tokens.tolist(), strict=True):
        ids[i] = t


def _apply_bias_and_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Add ``logit_bias`` and mask EOS / stop tokens before ``min_tokens`` outputs."""
    for i, r in enumerate(requests):
        p = r.sampling_params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), device=logits.device)
            vals = torch.tensor(list(p.logit_bias.values()), device=logits.device)
            logits[i].index_add_(0, ids, vals)
        if p.min_tokens and r.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids)
            if r.eos_token_id is not None and not p.ignore_eos:
                banned.append(r.eos_token_id)
            if banned:
                logits[i, banned] = float("-inf")


def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Repetition (prompt + output, CTRL), then frequency / presence (output only)."""
    for i, r in enumerate(requests):
        p = r.sampling_params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.all_token_ids)), device=logits.device)
            row = logits[i, seen]
            logits[i, seen] = torch.where(
                row > 0, row / p.repetition_penalty, row * p.repetition_penalty
            )
        if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=logits.device)
            counts = torch.zeros(logits.shape[1], dtype=torch.float32, device=logits.device)
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def is_plain_greedy(r: Request) -> bool:
    """Whether request ``r`` is greedy this step with no logits processor and no
    logprobs (its token is the plain argmax of the model's logits)."""
    p = r.sampling_params
    return p.greedy and p.logprobs is None and is_unprocessed(r)


def is_unprocessed(r: Request) -> bool:
    """Whether no logits processor (grammar mask, ``logit_bias``, ``min_tokens``,
    penalties: steps 0-2) changes request ``r``'s logits this step."""
    p = r.sampling_params
    return (
        not p.logit_bias
        and p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and not (p.min_tokens and r.num_output_tokens < p.min_tokens)
        and p.structured_outputs is None
    )


def is_temperature_only(p: SamplingParams) -> bool:
    """Whether a row of these params samples with its temperature alone (no min_p,
    top_k or top_p) and wants no logprobs: the rows the sampler draws with
    ``sample_race_logits`` from the processed logits, without a softmax. A temperature
    beyond float32's range (``inf``: uniform over the vocabulary) keeps the softmax path,
    whose division by it the race's ``1 / T`` does not cover."""
    return (
        not p.greedy
        and p.temperature <= _FLOAT32_MAX
        and p.top_k == -1
        and p.top_p == 1.0
        and p.min_p == 0.0
        and p.logprobs is None
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of ``[num_reqs, vocab]`` logits (float32 or bf16): ``[num_reqs]``
    int64, the first maximal index as ``argmax`` returns it.

    On the CPU the native kernel reads the rows once (``cpu_ext.argmax_rows_cpu``);
    elsewhere ``max(dim).indices``, which ran faster than ``argmax`` on the CPU
    (docs/benchmarks.md, "Kernel measurements").
    """
    if logits.device.type == "cpu":
        native = cpu_ext.argmax_rows_cpu(logits)
        if native is not None:
            return native
    return logits.max(dim=-1).indices


def _apply_top_k_top_p(logits: torch.Tensor, params: list, greedy: list[bool]) -> None:
    """Set logits outside each row's top-k and nucleus (top-p) to -inf, in place.

    Only the rows that ask for truncation are sorted. Top-p keeps the smallest set
    of most likely tokens whose probability sums to at least ``top_p`` (always at
    least one token). Ties at the k-th value are all kept.
    """
    rows = [
        i
        for i, (p, g) in enumerate(zip(params, greedy, strict=True))
        if not g and (p.top_k != -1 or p.top_p < 1.0)
    ]
    if not rows:
        return
    vocab = logits.shape[1]
    sub = logits[rows]
    ks = torch.tensor(
        [min(params[i].top_k, vocab) if params[i].top_k != -1 else vocab for i in rows],
        device=logits.device,
    )
    # NOTE: rows without top-p get an unreachable 2.0: float rounding can push the
    # cumulative sum to 1.0 before the tail, which must not cut anything.
    top_ps = torch.tensor(
        [params[i].top_p if params[i].top_p < 1.0 else 2.0 for i in rows], device=logits.device
    )
    sorted_logits, _ = sub.sort(dim=-1, descending=True)
    # top-k: threshold at the k-th largest value.
    kth = sorted_logits.gather(1, (ks - 1).unsqueeze(1))
    below_k = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(below_k, float("-inf"))
    # top-p over the (already top-k truncated) distribution.
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    exclusive_cumsum = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut = (exclusive_cumsum >= top_ps.unsqueeze(1)) | below_k
    cut[:, 0] = False
    # The smallest kept logit is the row's threshold: everything below it goes.
    kept = sorted_logits.masked_fill(cut, float("inf"))
    threshold = kept.min(dim=-1, keepdim=True).values
    sub = sub.masked_fill(sub < threshold, float("-inf"))
    logits[rows] = sub


def _apply_min_p(probs: torch.Tensor, params: list, greedy: list[bool]) -> None:
    """Zero probabilities below ``min_p * max_prob`` (rows with ``min_p > 0``), in place."""
    rows = [
        i for i, (p, g) in enumerate(zip(params, greedy, strict=True)) if not g and p.min_p > 0.0
    ]
    if not rows:
        return
    sub = probs[rows]
    min_ps = torch.tensor([params[i].min_p for i in rows], device=probs.device)
    threshold = sub.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
    probs[rows] = sub.masked_fill(sub < threshold, 0.0)


def gather_logprobs(
    processed: torch.Tensor, token_ids: list[int], params: list
) -> list[SampleResult]:
    """Per row, ``(token, {token_id: Logprob})`` for the sampled token and the top-N
    (``None`` for rows whose params ask for no logprobs).

    Args:
        processed: ``[num_rows, vocab]`` float32 processed logits, divided by the
            temperature for random rows (vLLM's "processed" logprobs).
        token_ids / params: per row, the emitted token and its request's params.
    """
    results: list[SampleResult] = []
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs = torch.log_softmax(processed[rows], dim=-1).cpu()
    by_row = dict(zip(rows, range(len(rows)), strict=True))
    for i, (tok, p) in enumerate(zip(token_ids, params, strict=True)):
        if p.logprobs is None:
            results.append((tok, None))
            continue
        row = logprobs[by_row[i]]
        sampled_lp = row[tok]
        rank = int((row > sampled_lp).sum().item()) + 1
        # The sampled token first, then the top-N (vLLM's order).
        entry: PositionLogprobs = {tok: Logprob(logprob=float(sampled_lp), rank=rank)}
        if p.logprobs > 0:
            top_vals, top_ids = row.topk(p.logprobs)
            for r, (v, t) in enumerate(
                zip(top_vals.tolist(), top_ids.tolist(), strict=True), start=1
            ):
                if v == float("-inf"):
                    break  # masked (a grammar allows fewer tokens than asked for)
                if t not in entry:
                    entry[t] = Logprob(logprob=v, rank=r)
        results.append((tok, entry))
    return results
