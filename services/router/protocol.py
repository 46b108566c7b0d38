"""OpenAI request and response models (pydantic), as the official ``openai`` client uses them.

Requests accept OpenAI's fields plus vLLM's extra sampling fields. Unknown fields are
ignored with a warning in the log, as vLLM does. Request models validate strictly
(pydantic's strict mode): a value of another JSON type is a 400, never coerced -- ``"yes"``
is no boolean, ``false`` no token id, ``"1"`` no number (an integer is a valid float). Every request model converts itself
to the engine's ``SamplingParams`` with :meth:`to_sampling_params`; a value the engine
rejects becomes an ``OpenAIError`` (HTTP 400) naming the field.

Source of the shapes: the OpenAI API reference (Completions, Chat Completions) and
vLLM's ``entrypoints/openai/protocol.py`` for the extra fields and their defaults.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Generic, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.engine.sampling_params import SamplingDefaults, SamplingParams
from tandem.engine.validation import RequestError, check_context_length
from tandem.services.router.api_models import (  # noqa: F401 - the routes' P.<name>
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from tandem.services.router.errors import OpenAIError, from_request_error
from tandem.services.router.structured import (
    Constraint,
    ConstraintSource,
    build_constraint,
    check_unsupported,
)
from tandem.services.router.tools import ToolChoice, check_tool_messages, parse_tool_choice

logger = logging.getLogger(__name__)

#: Most completions one request may ask for (``n``); bounds the router's fan-out.
MAX_N = 16
# Widths of the protobuf fields these values travel in to the engines (common.proto:
# ``int64 seed``, ``int32 top_k``; prefill/decode.proto: ``int32 priority``). A wider
# value must be a 400 naming the field, not a ValueError while building the RPC (500).
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)


#: Chat roles a request may use. ``developer`` (OpenAI's newer name for ``system``) reaches
#: a chat template that names it as is, else as ``system`` (``Frontend.apply_chat_template``).
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: frozenset[str] = frozenset(get_args(ChatRole))
#: pydantic config of every request model: strict types (see the module docstring).
_STRICT = ConfigDict(strict=True)


def default_max_tokens(default: int | None, room: int | None) -> int | None:
    """``max_tokens`` of a request that leaves it unset: ``default`` (the generation
    config's) within the ``room`` left in the context, or that room; ``None`` (up to the
    context length, as the engine caps it) when both are unknown."""
    if default is None or room is None:
        return default if room is None else room
    return min(default, room)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    model_config = _STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_INT64[0], le=_INT64[1])
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras.
    top_k: int | None = Field(None, ge=_INT32[0], le=_INT32[1])
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = Field(0, ge=_INT32[0], le=_INT32[1])
    # vLLM's: mixed into the first KV block's hash, so only requests with the same salt
    # share cached blocks (a tenant's prefix hits reveal nothing about another's prompts).
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: per prompt token, its logprob and this many top alternatives (prompt recomputed).
    prompt_logprobs: int | None = None
    # Structured outputs (services/router/structured.py): OpenAI's, vLLM's, vLLM's legacy.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _warn_unknown(self) -> _SamplingRequest:
        check_unsupported(self.model_extra)
        if self.model_extra:
            logger.warning("ignoring unknown request fields: %s", sorted(self.model_extra))
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token the engine computes (``None``: none)."""
        return self.prompt_logprobs

    def has_constraint_fields(self) -> bool:
        """Whether a field that sets a constraint or tools (JSON schemas to check) is set."""
        return any(getattr(self, name, None) is not None for name in (
            "response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar", "tools"))

    def constraint(self, extra: ConstraintSource | None = None) -> Constraint:
        """The request's output constraint, from whichever field set it.

        Args:
            extra: a constraint implied by another field (a forced tool call).

        Raises:
            OpenAIError: 400 naming the field(s) (``structured.build_constraint``).
        """
        legacy = {name: getattr(self, name) for name in
                  ("guided_json", "guided_regex", "guided_choice", "guided_grammar")}
        return build_constraint(response_format=self.response_format,
                                structured_outputs=self.structured_outputs, legacy=legacy,
                                extra=extra)

    def to_sampling_params(self, *, num_prompt_tokens: int, max_model_len: int | None,
                           constraint: Constraint | None = None,
                           defaults: SamplingDefaults | None = None) -> SamplingParams:
        """Build the engine's sampling parameters and check the context length.

        Args:
            num_prompt_tokens: tokens in the (templated) prompt.
            max_model_len: the model's context length in tokens, ``None`` while unknown
                (not checked here then: the engine checks it).
            constraint: the output constraint (``None``: :meth:`constraint`).
            defaults: values of the sampling fields the request leaves unset
                (``--generation-config``; ``None``: the API's).

        Returns:
            ``SamplingParams``; ``max_tokens`` defaults to ``defaults.max_tokens`` within
            the room left in the context, or to that room.

        Raises:
            OpenAIError: 400 ``context_length_exceeded`` when prompt + max_tokens does not
                fit, 400 naming the field for any other invalid value.
        """
        d = defaults or SamplingDefaults()
        max_tokens = self._requested_max_tokens()
        room = None
        if max_model_len is not None:
            try:
                check_context_length(num_prompt_tokens, max_model_len, max_tokens,
                                     field="messages")
            except RequestError as exc:
                raise from_request_error(exc) from exc
            room = max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens(d.max_tokens, room)
        if not 1 <= self.n <= MAX_N:
            raise OpenAIError(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as exc:
                raise OpenAIError(
                    "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
                ) from exc
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if constraint is None:
            constraint = self.constraint()
        try:
            return SamplingParams(
                n=self.n,
                **d.resolve(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            min_p=self.min_p, repetition_penalty=self.repetition_penalty),
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                logit_bias=logit_bias,
                min_tokens=self.min_tokens,
                max_tokens=max_tokens,
                ignore_eos=self.ignore_eos,
                stop_token_ids=list(self.stop_token_ids or []),
                stop=stop,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=self._num_logprobs(),
                prompt_logprobs=self.num_prompt_logprobs(),
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                structured_outputs=constraint.params,
            )
        except RequestError as exc:
            raise from_request_error(exc) from exc


#: Fields of Chat Completions that change its output; sent to /v1/completions, they would
#: be ignored, so they are refused there by name.
_CHAT_ONLY_FIELDS = ("messages", "tools", "tool_choice", "parallel_tool_calls",
                     "max_completion_tokens", "top_logprobs")


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, strings, token ids, or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (vLLM's and OpenAI's): the answer is the prompt
        and its logprobs; the engine samples one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def _requested_max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, else ``logprobs`` with ``echo`` (the echoed prompt's)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        for name in _CHAT_ONLY_FIELDS:
            if (self.model_extra or {}).get(name) is not None:
                raise OpenAIError(
                    f"{name} is a Chat Completions field; /v1/completions does not take it "
                    "(use /v1/chat/completions)",
                    param=name,
                )
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of != n is not supported", param="best_of")
        return self


class ChatMessage(BaseModel):
    """One chat message. ``content`` may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn's calls (OpenAI form) and a tool turn's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates take it (``content`` always a string)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg

    def text(self) -> str:
        """The message's text; text parts are joined, other part types rejected."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    def _num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if not self.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        for legacy in ("functions", "function_call"):
            if (self.model_extra or {}).get(legacy) is not None:
                raise OpenAIError(f"{legacy} is not supported; use tools and tool_choice",
                                  param=legacy)
        check_tool_messages([(m.role, m.tool_calls, m.tool_call_id) for m in self.messages])
        return self

    def tool_choice_spec(self) -> ToolChoice | None:
        """The request's tools and ``tool_choice``, validated (``None`` without tools).

        Raises:
            OpenAIError: 400 naming the field (``tools.parse_tool_choice``).
        """
        return parse_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)


# ---- responses -------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details`` (OpenAI's shape; vLLM's with
    ``--enable-prompt-tokens-details``, which tandem always has on)."""

    #: prompt tokens the engine that prefilled did not compute: its prefix cache or the
    #: KV store had their blocks. With n > 1, the first completion's count (all share the
    #: prompt); with several prompts, the sum over them, like ``prompt_tokens``.
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


_ChoiceT = TypeVar("_ChoiceT", bound=BaseModel)


class _Answer(BaseModel, Generic[_ChoiceT]):
    """The envelope every response and stream chunk shares; each subclass fixes
    ``object`` (and, for a whole response, defaults ``created`` to now)."""

    id: str
    object: str
    created: int  # Unix seconds
    model: str
    choices: list[_ChoiceT]
    usage: UsageInfo | None = None
    # tandem extension: where the time went (ns), on the final response/chunk only.
    timings: dict[str, Any] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: None, then per prompt token {token id: {"logprob", "rank", "decoded_token"}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(_Answer[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: the thinking (--reasoning-parser)
    # OpenAI form: [{"id", "type": "function", "function": {"name", "arguments"}}].
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Answer[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # as CompletionChoice


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # A call's first delta: {"index", "id", "type", "function": {"name", "arguments"}};
    # later ones {"index", "function": {"arguments": <more>}} (as OpenAI streams them).
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Answer[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChunk(_Answer[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"
