"""The proposer interface: draft tokens for the next step of each decoding request.

A proposer runs in the worker after each step's sample (vLLM v1's place for it): the
runner hands it, for each request the scheduler allows a lookahead, the request's
tokens including the ones this step produced, and gets back up to that many draft
tokens, which the scheduler schedules for verification in the next step. A proposer
keeps no state the scheduler cannot roll back: what it remembers per request (a draft
model's KV progress) is derived from tokens the request really has, and is dropped
when the request is preempted or finished.

NOTE: ``ProposeInput.hidden_states`` carries the target's last hidden states so that
an EAGLE / Medusa head can plug in behind the same interface; neither is built yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from tandem.engine.request import Request


@dataclass
class ProposeInput:
    """What a proposer gets for one request.

    Attributes:
        request: the request (read only; its ``all_token_ids`` lack ``new_token_ids``).
        new_token_ids: tokens this step produced for it (not yet in the request).
        max_num_tokens: most draft tokens wanted (>= 1).
        block_table: the request's block ids; room for ``max_num_tokens`` positions past
            its tokens is allocated (a draft model writes its own KV there).
        hidden_states: ``[len(new_token_ids), hidden_size]`` target hidden states of the
            positions that produced ``new_token_ids`` (model dtype), when the proposer
            asks for them (``Proposer.uses_hidden_states``), else ``None``.
    """

    request: Request
    new_token_ids: list[int]
    max_num_tokens: int
    block_table: list[int]
    hidden_states: torch.Tensor | None = None

    @property
    def token_ids(self) -> list[int]:
        """The request's tokens including this step's (prompt + output)."""
        return self.request.all_token_ids + self.new_token_ids


class Proposer(ABC):
    """Proposes draft tokens; called from the worker's one thread."""

    #: Whether ``propose`` needs ``ProposeInput.hidden_states`` (EAGLE-style heads).
    uses_hidden_states: bool = False

    @abstractmethod
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Draft tokens for each input, in order: at most ``max_num_tokens`` each, maybe
        none. Blocking (a draft model runs forward passes); mutates only the proposer's
        own state (and a draft model's KV cache)."""

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> torch.Tensor | None:
        """The distributions ``q`` the request's last proposal was drawn from, for its
        verification: ``[len(draft_token_ids), vocab]`` float32 (row ``j``: the draft's
        distribution at draft position ``j``), or ``None`` to verify the drafts as point
        masses (a deterministic proposer; the default).

        ``draft_token_ids`` are what the scheduler verifies: a prefix of the last
        proposal. ``None`` is always exact (a draft drawn independently of the
        verification's randomness may be verified as a point mass), only less likely
        to be accepted than with its ``q``.
        """
        return None

    def free(self, request_ids: Iterable[str]) -> None:  # noqa: B027 (optional hook)
        """Forget per-request state of preempted or finished requests (no-op by default)."""

    @property
    def block_bytes(self) -> int:
        """Bytes the proposer's own KV cache takes per KV block of the target (0: none);
        the target's KV budget is divided by its own block bytes plus these."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:  # noqa: B027 (optional hook)
        """Allocate the proposer's KV cache for the target's ``num_blocks`` blocks (no-op
        for a proposer without one)."""


def create_proposer(config: SpeculativeConfig, **kwargs: object) -> Proposer:
    """The proposer ``config.method`` names; the one place that maps a method to a class.

    ``kwargs`` go to the draft-model proposer (the target's facts it validates against).

    Raises:
        ValueError: naming the field, from the proposer (a draft model that does not fit
            the target).
    """
    if config.method == "ngram":
        from tandem.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    from tandem.engine.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, **kwargs)  # type: ignore[arg-type]
