"""The step's input batch: a ``SchedulerOutput`` flattened into one "super sequence".

Built once per step by ``build_input_batch``, before the forward: the token ids fed
(known tokens, then any draft tokens), each request's query length, computed tokens and
block table, and which rows of the forward's hidden states are sampled or verified.
(vLLM v1's ``InputBatch`` / ``_prepare_inputs``; nano-vllm's ``prepare_prefill``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import Request
from tandem.engine.sched_output import SchedulerOutput

__all__ = ["InputBatch", "build_input_batch"]


@dataclass
class InputBatch:
    """One step's flattened inputs.

    Attributes:
        input_ids: ``num_tokens`` token ids, request after request.
        query_lens: tokens fed per request (known tokens plus drafts).
        num_computed: per request, tokens already in its KV cache before this step.
        tables: per request, its block table (physical block ids).
        sample_rows: rows of the hidden states sampled (a request's last known token).
        sample_reqs: the requests of ``sample_rows``, in the same order.
        spec_rows: rows verified: per request with drafts, its last known token and every
            draft (``k + 1`` rows each), request after request.
        spec_reqs: the requests of ``spec_rows``.
        num_tokens: total tokens fed.
    """

    input_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_reqs: list[Request] = field(default_factory=list)
    spec_rows: list[int] = field(default_factory=list)
    spec_reqs: list[Request] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def is_decode_only(self) -> bool:
        """One token per request (what a captured CUDA graph holds)."""
        return self.num_tokens == len(self.query_lens)

    def hidden_rows_of(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """Request id -> the rows whose outputs are its new tokens this step (one row when
        sampled, ``k + 1`` when verified), for a proposer that reads hidden states."""
        rows_of: dict[str, list[int]] = {}
        for req, row in zip(self.sample_reqs, self.sample_rows, strict=True):
            rows_of[req.request_id] = [row]
        start = 0
        for req in self.spec_reqs:
            n = len(sched.scheduled_spec_token_ids[req.request_id]) + 1
            rows_of[req.request_id] = self.spec_rows[start : start + n]
            start += n
        return rows_of


def build_input_batch(sched: SchedulerOutput) -> InputBatch:
    """Flatten ``sched.scheduled_requests``: request ``r`` feeds
    ``all_token_ids[c : c + known]`` (``c = r.num_computed_tokens``) then its drafts
    (``sched.scheduled_spec_token_ids``), and is sampled (no drafts) or verified (drafts)
    iff ``c + known == r.num_tokens``. Reads requests; mutates nothing."""
    batch = InputBatch()
    for req in sched.scheduled_requests:
        n = sched.num_scheduled_tokens[req.request_id]
        drafts = sched.scheduled_spec_token_ids.get(req.request_id, [])
        known = n - len(drafts)
        c = req.num_computed_tokens
        if known == 1:
            batch.input_ids.append(req.all_token_ids[c])
        else:
            batch.input_ids.extend(req.all_token_ids[c : c + known])
        batch.input_ids.extend(drafts)
        batch.query_lens.append(n)
        batch.num_computed.append(c)
        batch.tables.append(sched.block_tables[req.request_id])
        batch.num_tokens += n
        if c + known == req.num_tokens:
            if drafts:
                # The last known token and every draft: k + 1 positions to verify.
                batch.spec_rows.extend(range(batch.num_tokens - len(drafts) - 1,
                                             batch.num_tokens))
                batch.spec_reqs.append(req)
            else:
                batch.sample_rows.append(batch.num_tokens - 1)
                batch.sample_reqs.append(req)
    return batch
