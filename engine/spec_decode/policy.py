"""The scheduler's side of speculative decoding: how many draft tokens each request
gets (the acceptance back-off), and the acceptance counters behind the metrics.

Back-off rule (``SpeculativeConfig.acceptance_backoff``), per request: it starts with
``num_speculative_tokens`` draft tokens per step; a verification that accepted none
halves that number (rounded down), one that accepted every draft token raises it by
one (up to ``num_speculative_tokens``). At 0 the request proposes nothing for
``BACKOFF_PAUSE_STEPS`` of its steps, then tries again with 1. A request whose text
does not repeat thus costs one verified draft token every few steps, while one that
copies its prompt climbs back to the full ``k`` within ``k`` steps.

Batch rule (:meth:`SpecDecodePolicy.worth_verifying`): a step verifies its drafts only
when they number at least one per decoding request in it. A step with drafts leaves the
one-token decode path for the whole batch (on CPU the fused decode kernel,
kernels/fused_decode.py, so one request's drafts make the whole step cost a multiple of
a fused one; docs/benchmarks.md, "Speculative decoding"), so a lone request's chance draft
in a batch of unrelated requests slows all of them for at most a few tokens of its
own; the per-request back-off cannot see that. Below the bar the drafts are dropped
unverified (the requests decode one token, and propose again). A batch of one always
verifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.config import BACKOFF_PAUSE_STEPS, SpeculativeConfig
from tandem.engine.request import Request


@dataclass
class SpecDecodeStats:
    """Cumulative acceptance counters (vLLM's ``spec_decode_*`` metrics).

    Attributes:
        num_drafts: verifications (steps of one request that had draft tokens).
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        num_accepted_tokens_per_pos: ``[k]``: how often the draft token at position
            ``j`` (0-based) was accepted.
    """

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verification of ``num_draft_tokens`` drafts, the first
        ``num_accepted_tokens`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for j in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 when none was verified)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts plus the target's own token
        (vLLM's definition; 1 when none was verified)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)


class SpecDecodePolicy:
    """Decides each request's number of draft tokens; counts acceptance.

    Args:
        config: the speculative config.
        max_seq_len: most tokens a sequence may hold (the scheduler's limit).
    """

    def __init__(self, config: SpeculativeConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        #: Whether the draft writes KV past the request's tokens (slots to reserve).
        self.needs_lookahead_slots = config.method == "draft_model"

    def num_lookahead(self, req: Request, num_running: int, num_computed_after: int) -> int:
        """Draft tokens to propose for ``req`` after a step that samples it, with
        ``num_computed_after`` of its tokens computed then; 0 for none. Counts down a
        backed-off request's pause.

        The caps: the request's current back-off ``k``; tokens left under
        ``max_tokens`` and the context (the step emits at least one, the next step at
        most ``k + 1``); ``disable_by_batch_size``.
        """
        cfg = self.config
        if req.num_spec_tokens < 0:
            req.num_spec_tokens = cfg.num_speculative_tokens
        if cfg.disable_by_batch_size is not None and num_running > cfg.disable_by_batch_size:
            return 0
        if req.spec_pause_steps > 0:
            req.spec_pause_steps -= 1
            if req.spec_pause_steps == 0:
                req.num_spec_tokens = 1
            return 0
        if req.prefill_only:
            return 0  # it finishes after this step's token: drafts would go unverified
        k = req.num_spec_tokens
        # After this step the request holds at least num_tokens + 1 tokens, of which
        # the next step's verification may add k + 1 more.
        num_after = num_computed_after + 1
        room = self.max_seq_len - num_after
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            num_output_after = num_after - req.num_prompt_tokens
            room = min(room, max_tokens - num_output_after)
        return max(0, min(k, room - 1))

    def num_verified(self, req: Request, budget: int) -> int:
        """How many of ``req.spec_token_ids`` its decode step verifies: all, less what
        the step's token ``budget`` (one for the known token), ``max_tokens`` or the
        context leave room for."""
        k = len(req.spec_token_ids)
        if not k:
            return 0
        room = self.max_seq_len - req.num_tokens
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens)
        return max(0, min(k, budget - 1, room - 1))

    @staticmethod
    def worth_verifying(num_draft_tokens: int, num_decodes: int) -> bool:
        """Whether a step whose ``num_decodes`` decoding requests carry
        ``num_draft_tokens`` drafts in all verifies them (the batch rule)."""
        return num_draft_tokens >= num_decodes

    def on_verified(self, req: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count a verification and adapt ``req``'s draft length (the back-off rule)."""
        self.stats.observe(num_draft_tokens, num_accepted_tokens)
        if not self.config.acceptance_backoff:
            return
        if num_accepted_tokens == 0:
            req.num_spec_tokens //= 2
            if req.num_spec_tokens == 0:
                req.spec_pause_steps = BACKOFF_PAUSE_STEPS
        elif num_accepted_tokens == num_draft_tokens:
            req.num_spec_tokens = min(req.num_spec_tokens + 1, self.config.num_speculative_tokens)
