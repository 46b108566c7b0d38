"""Text side shared by the HTTP and gRPC front doors: model names, tokenization, chat template.

The router owns the tokenizer: completions prompts are tokenized as given (special tokens
added as the tokenizer does by default, as vLLM does), chat messages are rendered with the
model's chat template (``add_generation_prompt``) and tokenized without adding special
tokens again (the template already holds them) -- the same rule as the offline ``LLM``.
"""

from __future__ import annotations

import importlib.resources
import uuid
from collections.abc import Sequence
from typing import Any

import jinja2

from tandem.engine.sampling_params import SamplingDefaults, SamplingParams
from tandem.engine.validation import RequestError, check_prompt_token_ids, check_vocab_params
from tandem.services.router.errors import OpenAIError, from_request_error, model_not_found
from tandem.services.router.pipeline import Pipeline
from tandem.services.router.protocol import CHAT_ROLES
from tandem.services.router.reasoning import (
    REASONING_PARSERS,
    ReasoningMode,
    reasoning_mode,
    think_end_token_id,
)


class Frontend:
    """Tokenizer-facing helpers plus the pipeline, built once by ``main``.

    Args:
        tokenizer: HF tokenizer of the served model.
        pipeline: the request pipeline.
        served_model_names: names accepted in ``model`` (the first is reported).
        max_model_len: the router's cap on the context length in tokens
            (``--max-model-len``), ``None`` for none: requests are validated against the
            smallest context length the instances report (:attr:`max_model_len`).
        api_key: required bearer token for ``/v1`` routes, or ``None``.
        chat_template: a Jinja chat template used instead of the model's for every
            request (``--chat-template``), or ``None``.
        tool_call_parser: how tool calls are read from the model's text
            (``--tool-call-parser``; ``tools.TOOL_CALL_PARSERS``).
        sampling_defaults: sampling values of fields a request leaves unset
            (``--generation-config``).
        reasoning_parser: how chat answers' thinking is split off (``--reasoning-parser``;
            ``reasoning.REASONING_PARSERS``), or ``None``.

    Raises:
        ValueError: an unknown ``reasoning_parser``, or one whose model's tokenizer lacks
            ``</think>`` as one token (``reasoning.think_end_token_id``).
    """

    def __init__(self, *, tokenizer: Any, pipeline: Pipeline, served_model_names: Sequence[str],
                 max_model_len: int | None = None, api_key: str | None = None,
                 chat_template: str | None = None, tool_call_parser: str = "hermes",
                 sampling_defaults: SamplingDefaults | None = None,
                 reasoning_parser: str | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                             f"{reasoning_parser!r}")
        self.reasoning_parser = reasoning_parser
        #: ``</think>``'s id, after which structured outputs start (with a reasoning parser)
        self.think_end_token_id = (think_end_token_id(tokenizer)
                                   if reasoning_parser is not None else None)
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        own = chat_template or getattr(tokenizer, "chat_template", None) or ""
        # NOTE: a template that never mentions `tools` would drop them silently; requests
        # with tools then use the shipped Hermes template (``tool_chat_template``).
        self.tool_chat_template: str | None = (
            None if "tools" in own else load_shipped_template("hermes_tool_use"))
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.served_model_names = list(served_model_names)
        self.max_model_len_cap = max_model_len
        self.api_key = api_key
        self._tokenizer_vocab_size = len(tokenizer)
        self._token_text: dict[int, str] = {}

    @property
    def max_model_len(self) -> int | None:
        """Context length in tokens requests are validated against: the smallest one the
        instances serving the model report, capped by ``--max-model-len``; ``None`` while
        neither is known (the engine then validates; with no instance up a request gets
        the pipeline's 503)."""
        reported = self.pipeline.discovery.facts.max_model_len
        known = [n for n in (self.max_model_len_cap, reported) if n is not None]
        return min(known) if known else None

    @property
    def vocab_size(self) -> int:
        """Token ids accepted: ``[0, vocab_size)``, past both the tokenizer's ids and the
        vocabulary the instances report (vLLM's rule: a model may hold more ids than its
        tokenizer, Qwen's padded embedding, or fewer)."""
        reported = self.pipeline.discovery.facts.vocab_size or 0
        return max(self._tokenizer_vocab_size, reported)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """Raises: OpenAIError 404 ``model_not_found`` when ``model`` is not served here."""
        if model and model not in self.served_model_names:
            raise model_not_found(model)

    @staticmethod
    def new_request_id(given: str | None) -> str:
        """The caller's ``X-Request-Id`` if given (non-empty, printable), else a fresh one."""
        if given:
            given = given.strip()
            if not given.isprintable() or len(given) > 256:
                raise OpenAIError("X-Request-Id must be printable and at most 256 characters",
                                  param="X-Request-Id")
            if given:
                return given
        return uuid.uuid4().hex

    def tokenize_prompts(self, prompt: Any) -> list[list[int]]:
        """Completions ``prompt`` (str, list of str, ids, list of ids) -> token id lists.

        Raises:
            OpenAIError: 400 on an empty prompt or token ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError("prompt must not be empty", param="prompt")
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            self.check_token_ids(ids, "prompt")
            out.append(ids)
        return out

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Raises: OpenAIError 400 naming ``param`` when ``ids`` is empty or leaves the
        vocabulary (the engine's rule, ``engine.validation``)."""
        try:
            check_prompt_token_ids(ids, self.vocab_size, param)
        except RequestError as exc:
            raise from_request_error(exc) from exc

    def check_sampling_params(self, sp: SamplingParams) -> None:
        """Raises: OpenAIError 400 when logit_bias / stop_token_ids name unknown token ids."""
        try:
            check_vocab_params(sp, self.vocab_size)
        except RequestError as exc:
            raise from_request_error(exc) from exc

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render chat messages with the chat template and tokenize.

        The template is ``--chat-template`` if given, else the model's; a request with
        ``tools`` (or with tool turns) whose template has no tool support uses the
        shipped Hermes template instead. A ``developer`` message reaches a template that
        never names that role as ``system`` (OpenAI's meaning of it), rather than as a
        role the model was never trained on.

        Raises:
            OpenAIError: 400 for a role outside ``protocol.CHAT_ROLES`` (``param``
                ``messages.<i>.role``), or when the template rejects the messages or
                yields no tokens.
        """
        for i, m in enumerate(messages):
            if m.get("role") not in CHAT_ROLES:
                raise OpenAIError(f"messages.{i}.role: {m.get('role')!r} is no chat role; "
                                  f"expected one of {', '.join(sorted(CHAT_ROLES))}",
                                  param=f"messages.{i}.role")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False
        template = self.chat_template
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls")
                                        for m in messages)
        if uses_tools and self.tool_chat_template is not None:
            template = self.tool_chat_template
        source = template if template is not None else getattr(self.tokenizer,
                                                              "chat_template", None)
        if "developer" not in str(source or ""):
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m
                        for m in messages]
        extra: dict[str, Any] = dict(kwargs or {})
        if template is not None:
            extra["chat_template"] = template
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **extra)
        except jinja2.exceptions.UndefinedError as exc:
            raise OpenAIError(
                "messages: the chat template needs something these messages lack "
                f"({exc.message})", param="messages") from exc
        except Exception as exc:  # noqa: BLE001 - jinja raises many types for bad input
            raise OpenAIError(f"messages: the chat template refused these messages: {exc}",
                              param="messages") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_token_ids(ids, "messages")
        return ids

    def reasoning_mode(self, prompt_ids: Sequence[int],
                       chat_template_kwargs: dict[str, Any] | None) -> ReasoningMode | None:
        """How the answer to the chat prompt ``prompt_ids`` is split into thinking and
        answer (``reasoning.reasoning_mode``), ``None`` without a reasoning parser."""
        if self.reasoning_parser is None:
            return None
        # a few tokens are enough to hold an open <think> and the whitespace after it
        tail = self.tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False)
        return reasoning_mode(self.reasoning_parser, tail, chat_template_kwargs)

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (logprobs entries), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text


def load_shipped_template(name: str) -> str:
    """A chat template shipped in ``services/router/chat_templates/<name>.jinja``."""
    files = importlib.resources.files("tandem.services.router") / "chat_templates"
    return (files / f"{name}.jinja").read_text(encoding="utf-8")


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value: a file path, a shipped template's name, or the template.

    Raises:
        ValueError: naming ``--chat-template`` when a path-like value names no file.
    """
    import os

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    shipped = importlib.resources.files("tandem.services.router") / "chat_templates"
    if (shipped / f"{value}.jinja").is_file():
        return load_shipped_template(value)
    if "{" not in value:
        raise ValueError(f"--chat-template: no file {value!r} and no shipped template of "
                         "that name (and it is no Jinja template)")
    return value
