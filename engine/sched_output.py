"""The scheduler's output: what the model runner executes in one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.engine.request import Request

if TYPE_CHECKING:
    from tandem.engine.structured_output.manager import StepBitmask


@dataclass
class SchedulerOutput:
    """One step's batch.

    ``scheduled_requests`` is the batch order: running decodes first, then
    prefills (new, resumed or chunked). For each request the model runner
    feeds tokens ``all_token_ids[num_computed_tokens : num_computed_tokens + n]``
    with ``n = num_scheduled_tokens[request_id]``; ``request.num_computed_tokens``
    is NOT advanced until ``Scheduler.update_from_output``. A request is
    sampled iff ``num_computed_tokens + n == request.num_tokens``.

    Attributes:
        scheduled_requests: requests in batch order.
        num_scheduled_tokens: request_id -> tokens to compute this step.
        block_tables: request_id -> the request's full block table (block ids).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens`` values.
        preempted_req_ids: requests preempted (blocks freed) this step.
        finished_req_ids: requests that finished since the last step (the runner
            may drop per-request state).
        kv_connector_metadata: connector-specific work for the worker side.
        grammar_bitmask: the allowed tokens of the constrained requests sampled this
            step (``structured_output.manager.StepBitmask``: an int32 bitmask and each
            request's row), applied by the sampler before every other rule; ``None``
            when no sampled request is constrained.
        scheduled_spec_token_ids: request_id -> the draft tokens verified this step
            (speculative decoding). They follow the request's known tokens in its input
            and are counted in ``num_scheduled_tokens``: a request with ``d`` of them is
            fed ``all_token_ids[c : c + n - d] + drafts`` and sampled iff
            ``c + n - d == request.num_tokens``, at each of its last ``d + 1`` positions.
        num_lookahead_tokens: request_id -> most draft tokens the proposer may propose
            for it after this step's sample (absent: none); its block table already has
            room for them beyond this step's tokens.
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    grammar_bitmask: StepBitmask | None = None
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    def num_known_tokens(self, request: Request) -> int:
        """Tokens of ``request`` fed this step that are already in ``all_token_ids``
        (the scheduled ones less the draft tokens)."""
        rid = request.request_id
        return self.num_scheduled_tokens[rid] - len(self.scheduled_spec_token_ids.get(rid, ()))

    def is_sampled(self, request: Request) -> bool:
        """Whether ``request`` reaches the end of its known tokens this step."""
        return request.num_computed_tokens + self.num_known_tokens(request) == request.num_tokens

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Result of one forward step.

    Attributes:
        sampled_token_ids: request_id -> sampled token, only for requests that
            reached the end of their known tokens this step.
        logprobs: request_id -> logprobs of the sampled position (token id ->
            Logprob: the sampled token and the top-N), when requested.
        verified_token_ids: request_id -> the tokens a step with draft tokens produced
            for it, in order: the accepted drafts, then one token of the target's (the
            recovered or bonus token); such a request is not in ``sampled_token_ids``.
        verified_logprobs: request_id -> logprobs of each of its ``verified_token_ids``,
            when requested.
        draft_token_ids: request_id -> draft tokens proposed after this step's sample
            (at most ``SchedulerOutput.num_lookahead_tokens``), for the next step.
        prompt_logprobs: request_id -> ``(start, positions)``: the prompt logprobs this
            step's chunk computed, ``positions[i]`` for prompt token ``start + 1 + i``
            (``engine/prompt_logprobs.py``).
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[Any]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[Any]]] = field(default_factory=dict)
