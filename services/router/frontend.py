"""Text side shared by the HTTP and gRPC front doors: model names, tokenization, chat template.

The router owns the tokenizer: completions prompts are tokenized as given (special tokens
added as the tokenizer does by default, as vLLM does), chat messages are rendered with the
model's chat template (``add_generation_prompt``) and tokenized without adding special
tokens again (the template already holds them) -- the same rule as the offline ``LLM``.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.validation import RequestError, check_prompt_token_ids, check_vocab_params
from tandem.services.router.errors import OpenAIError, from_request_error
from tandem.services.router.pipeline import Pipeline


class Frontend:
    """Tokenizer-facing helpers plus the pipeline, built once by ``main``.

    Args:
        tokenizer: HF tokenizer of the served model.
        pipeline: the request pipeline.
        served_model_names: names accepted in ``model`` (the first is reported).
        max_model_len: context length in tokens.
        api_key: required bearer token for ``/v1`` routes, or ``None``.
    """

    def __init__(self, *, tokenizer: Any, pipeline: Pipeline, served_model_names: Sequence[str],
                 max_model_len: int, api_key: str | None = None) -> None:
        if not served_model_names:
            raise ValueError("served_model_names must not be empty")
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.served_model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self.api_key = api_key
        self.vocab_size = len(tokenizer)
        self._token_text: dict[int, str] = {}

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """Raises: OpenAIError 404 ``model_not_found`` when ``model`` is not served here."""
        if model and model not in self.served_model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", status_code=404,
                              param="model", code="model_not_found")

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
                            kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render chat messages with the model's template and tokenize.

        Raises:
            OpenAIError: 400 when the template rejects the messages or yields no tokens.
        """
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - jinja raises many types for bad input
            raise OpenAIError(f"chat template failed on these messages: {exc}",
                              param="messages") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_token_ids(ids, "messages")
        return ids

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (logprobs entries), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text
