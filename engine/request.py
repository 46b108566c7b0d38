"""Request state inside the engine (vLLM v1 ``Request`` in spirit)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tandem.contracts.block_key import KVTransferParams, PublishInFlight
from tandem.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.engine.structured_output.manager import GrammarState


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; ordered so that ``status > PREEMPTED`` means finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    # Its grammar (structured outputs) is compiling off the step loop.
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # A ``prefill_only`` request whose token 1 does not end it: this engine's part is
    # done, the request goes on elsewhere (a decode instance); not a final reason.
    FINISHED_PREFILL_DONE = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """OpenAI finish_reason for a finished status ("prefill_done" for
        ``FINISHED_PREFILL_DONE``, which is not one of OpenAI's: see ``Request.prefill_only``),
        else ``None``."""
        return _FINISH_REASON.get(status)


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for output position ``position`` of a request seeded with ``seed``.

    SplitMix64's finaliser (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014) over ``seed`` and ``position``: nearby seeds and positions
    give unrelated generator states.

    Args:
        seed: the request's ``SamplingParams.seed`` (any int; taken modulo 2**64).
        position: output token index, >= 0.

    Returns:
        An int in ``[0, 2**63)`` for ``torch.Generator.manual_seed``.
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


#: Salt of the draft model's seeds: its draws at a position must be independent of the
#: target's (rejection sampling is exact only for a proposal drawn independently of
#: the verification's uniforms).
_DRAFT_SALT = 0x6A09E667F3BCC909


def draft_position_seed(seed: int, position: int) -> int:
    """The seed of a draft model's draw for output position ``position`` of a request
    seeded with ``seed``: :func:`position_seed` of a salted seed, so the draft's draws
    for a position are unrelated to the target's for any position.

    Returns:
        An int in ``[0, 2**63)`` for ``torch.Generator.manual_seed``.
    """
    return position_seed(seed ^ _DRAFT_SALT, position)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_PREFILL_DONE: "prefill_done",
}


@dataclass
class Logprob:
    """Logprob of one token. ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated position: token id -> Logprob for the sampled token and the top-N.
PositionLogprobs = dict[int, Logprob]


@dataclass(eq=False)
class Request:
    """Mutable state of one sequence in the engine.

    ``all_token_ids`` = prompt + output; ``num_computed_tokens`` counts tokens
    whose K/V is already in the paged cache (prefix hits and remote loads
    included). A request needs a sample when, after this step,
    ``num_computed_tokens == num_tokens``.

    Attributes:
        request_id: unique id within the engine.
        prompt_token_ids: prompt, ``list[int]`` of token ids.
        sampling_params: validated ``SamplingParams``.
        arrival_time: ``time.monotonic()`` seconds at arrival.
        priority: lower value is served first under the priority policy.
        cache_salt: mixed into the first block's hash (vLLM's request field), so only
            requests with the same salt share prefix-cache and KV-store blocks;
            ``None`` or ``""``: unsalted.
        eos_token_id: model's EOS id (``None`` when unknown).
        kv_transfer_params: where the prompt's KV lies in the KV store (decode
            side: the prefill's block hashes and layout fingerprint), read by the
            KV connector, opaque to the scheduler.
        kv_publish_in_flight: an output publish of some of the prompt's blocks that may
            still be running (the router's hint for a chat's next turn), read by the
            KV connector's store lookup, opaque to the scheduler.
        trace_headers: W3C ``traceparent``/``tracestate`` of the service's span of this
            request when the service traces (vLLM's field), carried to the KV store with
            the request's transfers; ``None`` otherwise.
        prefill_only: the engine computes the prompt and samples token 1 only (a
            disaggregated prefill, vLLM's ``do_remote_decode``): the stop rule still
            runs once against the caller's real ``sampling_params``, and when token 1
            does not end the request it finishes ``FINISHED_PREFILL_DONE`` (finish
            reason "prefill_done") instead of going on; no draft tokens are proposed.
        structured_output: the grammar state of a constrained request (set by the
            engine's ``StructuredOutputManager``), else ``None``.
        spec_token_ids: draft tokens proposed after the last step, verified by the next
            one (speculative decoding); never part of ``all_token_ids``.
        num_spec_tokens: how many draft tokens the request gets per step now (the
            scheduler's acceptance back-off adapts it); ``-1`` until first scheduled.
        spec_pause_steps: steps left before a backed-off request proposes again.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, the entries computed so
            far of prompt tokens ``1 ..`` (entry ``i`` is token ``i + 1``'s), until they
            go out with the first token (``take_prompt_logprobs``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    kv_publish_in_flight: PublishInFlight | None = None
    trace_headers: dict[str, str] | None = None
    prefill_only: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens served from the local prefix cache (or remote KV) at first schedule.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Monotonic seconds of the first schedule / first token, for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    structured_output: GrammarState | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    num_spec_tokens: int = -1
    spec_pause_steps: int = 0
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs_taken: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None and self.generator is None:
            # no seeding here: step_generator seeds it for each output position it draws
            self.generator = torch.Generator(device="cpu")

    def step_seed(self) -> int | None:
        """The seed of this request's draws for the output position sampled next
        (``position_seed``; see :meth:`step_generator`), ``None`` when unseeded."""
        seed = self.sampling_params.seed
        return None if seed is None else position_seed(seed, self.num_output_tokens)

    def step_generator(self) -> torch.Generator | None:
        """The request's generator, reseeded for the output position sampled next.

        A seeded request's draws for output position ``i`` come from
        ``position_seed(seed, i)``, not from a stream that every earlier draw advanced,
        so an engine that resumes the request at position ``i`` (another instance after
        a failure, a decode instance after the prefill's first token) samples what the
        first one would have. ``None`` for an unseeded request.
        """
        seed = self.step_seed()
        if self.generator is None or seed is None:
            return None
        self.generator.manual_seed(seed)
        return self.generator

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int, logprobs: PositionLogprobs | None = None) -> None:
        """Record one generated token (and its logprobs when requested)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def add_prompt_logprobs(self, start: int, positions: list[PositionLogprobs]) -> None:
        """Record one chunk's prompt logprobs: ``positions[i]`` is prompt token
        ``start + 1 + i``'s entry. Entries from ``start`` on are replaced (a preempted
        request recomputes its prompt from the start)."""
        del self.prompt_logprobs[start:]
        self.prompt_logprobs.extend(positions)

    def take_prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        """The prompt logprobs to send with this request's first output: ``None`` for
        prompt token 0, then one entry per later prompt token (vLLM's form); ``None``
        when not asked for or already taken."""
        if self.sampling_params.prompt_logprobs is None or self.prompt_logprobs_taken:
            return None
        self.prompt_logprobs_taken = True
        entries: list[PositionLogprobs | None] = [None]
        entries.extend(self.prompt_logprobs)
        self.prompt_logprobs = []
        return entries

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
