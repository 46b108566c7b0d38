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
    """

    scheduled_requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    grammar_bitmask: StepBitmask | None = None

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
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
