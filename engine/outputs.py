"""Engine outputs: token-level (``EngineCoreOutput``) and text-level (``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import PositionLogprobs
from tandem.engine.validation import RequestError


@dataclass
class EngineCoreOutput:
    """What one engine step produced for one request (token in, token out).

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (usually one).
        new_logprobs: per new token, the sampled token's and top-N logprobs,
            when the request asked for logprobs; else ``None``.
        prompt_logprobs: with the request's first token only, when it asked for
            prompt logprobs: ``None`` for prompt token 0, then per prompt token its
            logprob (with rank) and the top-k (``engine/prompt_logprobs.py``).
        finish_reason: "stop" | "length" | "abort" once finished, else ``None``;
            "prefill_done" for a ``Request.prefill_only`` request whose first token
            does not end it (the engine's part is over, the request is not: not a
            final reason, never sent to a client as one).
        stop_reason: the stop token id that finished it, if any.
        num_cached_tokens: prompt tokens served from cache (local or remote).
        error: why the engine failed the request (finish reason "abort"): its grammar
            did not compile or timed out, or rejected a token it already had.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    Attributes:
        index: 0..n-1.
        text: detokenized text so far (cumulative).
        token_ids: generated token ids so far (cumulative).
        cumulative_logprob: sum of sampled tokens' logprobs (when logprobs requested).
        logprobs: per generated token, token id -> Logprob (when requested).
        finish_reason: "stop" | "length" | "abort" | None.
        stop_reason: the stop string or stop token id that matched, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Text-level output of a request, as the offline ``LLM`` returns it.

    Attributes:
        request_id: the request id.
        prompt: prompt text when given as text, else ``None``.
        prompt_token_ids: the prompt's token ids.
        outputs: one ``CompletionOutput`` per completion (``n`` of them).
        finished: all completions finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: ``None`` for the first
            prompt token, then per prompt token a dict token id -> ``Logprob`` (the
            token itself, then the top-k, each with its rank and decoded text), as vLLM
            returns them; ``None`` when not asked for.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
