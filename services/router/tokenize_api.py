"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's bodies and answers, on the
router's tokenizer and chat template.

``/tokenize`` takes a ``prompt`` (tokenized as completions tokenize it, special tokens
added unless ``add_special_tokens`` is false) or chat ``messages`` (rendered as chat
completions render them: the same template, tools and ``chat_template_kwargs``, so
``count`` equals a chat answer's ``usage.prompt_tokens``) and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs`` only, else ``null``). ``/detokenize`` takes ``{"model", "tokens"}``
and answers ``{"prompt"}``; an id the tokenizer does not hold is a 400 naming ``tokens``.
Both need the router's API key when it has one. Source of the shapes: vLLM's
``TokenizeCompletionRequest``, ``TokenizeChatRequest``, ``TokenizeResponse``,
``DetokenizeRequest`` and ``DetokenizeResponse``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tandem.services.router import openapi
from tandem.services.router import protocol as P
from tandem.services.router.body import read_json_body
from tandem.services.router.door import Door
from tandem.services.router.errors import OpenAIError
from tandem.services.router.openai_routes import render_chat

_FORBID = ConfigDict(extra="forbid", strict=True)


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a ``prompt``."""

    model_config = _FORBID

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with chat ``messages``."""

    model_config = _FORBID

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = _FORBID

    model: str | None = None
    tokens: list[int]


#: The request models, for ``/openapi.json`` (``openapi.install``).
REQUEST_MODELS: tuple[type[BaseModel], ...] = (TokenizeCompletionRequest, TokenizeChatRequest,
                                                DetokenizeRequest)


def install(app: FastAPI, door: Door) -> None:
    """Add ``/tokenize`` and ``/detokenize`` to ``app``."""
    fe = door.fe
    errors: dict[int | str, dict[str, Any]] = {
        k: v for k, v in openapi.GENERATION_ERRORS.items() if k in (400, 401, 404, 413)}

    one_of = [openapi.request_body(m)["requestBody"]["content"]["application/json"]["schema"]
              for m in REQUEST_MODELS[:2]]

    @app.post("/tokenize", responses=errors, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": {"oneOf": one_of}}}}})
    async def tokenize(request: Request) -> JSONResponse:
        body = await _body(request)
        req: TokenizeCompletionRequest | TokenizeChatRequest
        if isinstance(body, dict) and "messages" in body:
            req = TokenizeChatRequest.model_validate(body)
            if req.add_special_tokens:
                raise OpenAIError("add_special_tokens: true is not supported with messages "
                                  "(the chat template holds the special tokens)",
                                  param="add_special_tokens")
            fe.check_model(req.model)
            chat = P.ChatCompletionRequest.model_validate({
                "messages": req.messages, "tools": req.tools,
                "chat_template_kwargs": req.chat_template_kwargs,
                "add_generation_prompt": req.add_generation_prompt,
                "continue_final_message": req.continue_final_message})
            ids = render_chat(fe, chat, chat.tool_choice_spec())
        else:
            req = TokenizeCompletionRequest.model_validate(body)
            fe.check_model(req.model)
            ids = list(fe.tokenizer.encode(req.prompt,
                                           add_special_tokens=req.add_special_tokens))
        strs = fe.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": fe.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize", responses=errors,
              openapi_extra=openapi.request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        req = DetokenizeRequest.model_validate(await _body(request))
        fe.check_model(req.model)
        num_ids = len(fe.tokenizer)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < num_ids:
                raise OpenAIError(f"tokens[{i}]: token id {t} is outside the vocabulary "
                                  f"[0, {num_ids})", param="tokens")
        return JSONResponse({"prompt": fe.tokenizer.decode(req.tokens)})

    async def _body(request: Request) -> Any:
        door.check_auth(request)
        return await read_json_body(request, door.max_body_bytes)
