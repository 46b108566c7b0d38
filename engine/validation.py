"""The request validator: every rule a request must meet before an engine takes it, once.

The engine core, its scheduler, the engine services (on protobuf requests) and the router
(on OpenAI requests) all call these pure functions, each with the limits it knows: the
router knows the vocabulary and the context length; an engine also knows its KV cache and
step budget. A rule therefore reads the same wherever it rejects a request, and every
error names the field at fault (:attr:`RequestError.field`), which the router reports as
the OpenAI error's ``param`` and the services as an INVALID_ARGUMENT message.

What the request's own values must satisfy (ranges of temperature, top_p, ...) is checked
by ``SamplingParams`` itself when it is built; this module checks a request against a
model and an engine.

Imports no torch (the router imports it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that breaks a rule; the message and :attr:`field` name the field.

    Attributes:
        field: the request field at fault, e.g. ``"prompt_token_ids"`` or ``"top_p"``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class KVCapacityError(RequestError):
    """The prompt can never fit in this engine's KV cache (an engine with a larger cache
    could take it: the services answer RESOURCE_EXHAUSTED, so the router tries another)."""


class GrammarCompilerBusyError(RequestError):
    """The engine's grammar compiler has more work queued than it can start in time (the
    services answer RESOURCE_EXHAUSTED: a retry, or another instance, may take it)."""


class ContextLengthError(RequestError):
    """The prompt, or the prompt plus ``max_tokens``, does not fit in the context length.

    Attributes:
        num_prompt_tokens: tokens in the prompt.
        max_tokens: the requested completion length, or ``None`` if not given.
        max_model_len: the context length in tokens.
    """

    def __init__(
        self, field: str, message: str, *, num_prompt_tokens: int, max_tokens: int | None,
        max_model_len: int,
    ) -> None:
        super().__init__(field, message)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against; ``None`` means "not known here, not checked".

    Attributes:
        max_model_len: the context length (prompt + output) in tokens.
        vocab_size: token ids must be in ``[0, vocab_size)``.
        max_kv_tokens: tokens the engine's whole KV cache holds (blocks x block size); a
            longer sequence could never be scheduled.
        max_prefill_tokens: with chunked prefill off, the most prompt tokens one step
            computes (``max_num_batched_tokens``); ``None`` with chunked prefill on.

    Raises:
        ValueError: a limit below 1, naming it.
    """

    max_model_len: int
    vocab_size: int | None = None
    max_kv_tokens: int | None = None
    max_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "vocab_size", "max_kv_tokens", "max_prefill_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A non-zero ``priority`` needs the priority policy (vLLM rejects it under FCFS
    rather than ignoring it, so a client learns its priority has no effect).

    Raises:
        RequestError: naming ``priority`` when it is not 0 and ``scheduling_policy`` is
            not ``"priority"``.
    """
    if priority != 0 and scheduling_policy != "priority":
        raise RequestError(
            "priority",
            f"priority {priority} needs --scheduling-policy priority; this engine "
            f"schedules {scheduling_policy} (send priority 0 or omit it)",
        )


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Every id in ``[0, vocab_size)``.

    Raises:
        RequestError: naming ``field`` and the first id outside the vocabulary.
    """
    if not token_ids:
        return
    lo, hi = min(token_ids), max(token_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise RequestError(field, f"{field} contains token id {bad} outside [0, {vocab_size})")


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int | None, field: str) -> None:
    """A prompt: not empty, and (when ``vocab_size`` is known) in the vocabulary.

    Raises:
        RequestError: naming ``field``.
    """
    if len(token_ids) == 0:
        raise RequestError(field, f"{field} must not be empty (the prompt has no tokens)")
    if vocab_size is not None:
        check_token_ids(token_ids, vocab_size, field)


def check_context_length(
    num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None,
    *, field: str = "prompt_token_ids",
) -> None:
    """At least one token must fit after the prompt; and ``max_tokens``, when given and
    the caller wants it enforced (the router, as OpenAI does; the engine instead caps
    generation at the context length), must fit too.

    Raises:
        ContextLengthError: naming ``field`` (the prompt) or ``"max_tokens"``.
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextLengthError(
            field,
            f"prompt length {num_prompt_tokens} must be < max_model_len {max_model_len} "
            f"({field}: 1..{max_model_len - 1} tokens)",
            num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
            max_model_len=max_model_len,
        )
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthError(
            "max_tokens",
            f"max_tokens {max_tokens} must be <= {room}: the context length {max_model_len} "
            f"minus the prompt's {num_prompt_tokens} tokens",
            num_prompt_tokens=num_prompt_tokens, max_tokens=max_tokens,
            max_model_len=max_model_len,
        )


def check_vocab_params(params: SamplingParams, vocab_size: int) -> None:
    """Token ids inside the sampling parameters name tokens of the vocabulary.

    Raises:
        RequestError: a ``logit_bias`` key, ``stop_token_ids`` entry or
            ``structured_outputs.after_token_id`` outside ``[0, vocab_size)``, naming
            that field.
    """
    for tok in params.logit_bias or {}:
        if not 0 <= tok < vocab_size:
            raise RequestError("logit_bias", f"logit_bias token id {tok} outside [0, {vocab_size})")
    for tok in params.stop_token_ids:
        if not 0 <= tok < vocab_size:
            raise RequestError(
                "stop_token_ids", f"stop_token_ids entry {tok} outside [0, {vocab_size})"
            )
    so = params.structured_outputs
    if so is not None and so.after_token_id is not None and not so.after_token_id < vocab_size:
        raise RequestError(
            "structured_outputs.after_token_id",
            f"structured_outputs.after_token_id {so.after_token_id} outside [0, {vocab_size})",
        )


def validate_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, limits: RequestLimits,
    *, field: str = "prompt_token_ids",
) -> None:
    """Every rule a request must meet against ``limits``; allocates and mutates nothing.

    Rules, in this order (the first broken one is reported; capacity comes last, since
    another engine may have room where this one has not):

    1. the prompt is not empty;
    2. the prompt leaves room for one token in ``max_model_len``;
    3. prompt ids, ``logit_bias`` keys and ``stop_token_ids`` are in the vocabulary;
    4. with chunked prefill off, the prompt fits in one step's budget;
    5. prompt plus one token fits in the KV cache.

    Args:
        prompt_token_ids: the prompt's token ids.
        params: the request's (already self-validated) sampling parameters.
        limits: what the caller knows of the model and engine.
        field: the name the caller's API gives the prompt (``"prompt"``, ``"messages"``).

    Raises:
        ContextLengthError: rule 2. KVCapacityError: rule 5. RequestError: the others.
    """
    check_prompt_token_ids(prompt_token_ids, None, field)
    num_tokens = len(prompt_token_ids)
    check_context_length(num_tokens, limits.max_model_len, field=field)
    if limits.vocab_size is not None:
        check_token_ids(prompt_token_ids, limits.vocab_size, field)
        check_vocab_params(params, limits.vocab_size)
    if limits.max_prefill_tokens is not None and num_tokens > limits.max_prefill_tokens:
        raise RequestError(
            field,
            f"prompt length {num_tokens} must be <= max_num_batched_tokens "
            f"{limits.max_prefill_tokens} when chunked prefill is off",
        )
    if limits.max_kv_tokens is not None and num_tokens >= limits.max_kv_tokens:
        raise KVCapacityError(
            field,
            f"prompt length {num_tokens} must be < {limits.max_kv_tokens}, the tokens the KV "
            "cache holds",
        )
