"""OpenAI's generation routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``
(``stream`` as server-sent events or not), and the chat pipeline the other front doors
(Responses, Anthropic Messages) translate their requests into (:func:`prepare_chat`,
:func:`chat_message`).

Bodies are read by ``body.read_json_body`` (size limit, UTF-8, valid Unicode) and
validated by the strict pydantic models of ``protocol``; ``/openapi.json`` documents them
(``openapi``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.engine.sampling_params import SamplingParams
from tandem.services.router import openapi
from tandem.services.router import protocol as P
from tandem.services.router.chat_streamers import ChatStreamer, CompletionStreamer
from tandem.services.router.door import Door
from tandem.services.router.frontend import Frontend
from tandem.services.router.prompt_logprobs import completion_choice, vllm_prompt_logprobs
from tandem.services.router.reasoning import ReasoningMode, constrain_answer
from tandem.services.router.responses import (
    ChoiceState,
    chat_logprobs,
    usage,
)
from tandem.services.router.sequence import GenerationRequest
from tandem.services.router.streaming import CLIENT_GONE, collect, stream
from tandem.services.router.structured import Constraint
from tandem.services.router.tools import ToolCallParser, ToolChoice, finish_reason_with_calls

_T = TypeVar("_T")


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready for the pipeline.

    Attributes:
        gen: the generation request (prompt token ids, sampling parameters).
        num_prompt_tokens: tokens in the templated prompt.
        parses: the tools whose calls are parsed out of the text, or ``None``.
        reasoning: how the thinking is split from the answer (``--reasoning-parser``), or
            ``None``.
    """

    gen: GenerationRequest
    num_prompt_tokens: int
    parses: ToolChoice | None
    reasoning: ReasoningMode | None = None

    @property
    def sampling_params(self) -> SamplingParams:
        return self.gen.sampling_params


async def prepare_chat(fe: Frontend, req: P.ChatCompletionRequest, rid: str, arrival_ns: int,
                       rename: Callable[[str], str] | None = None) -> PreparedChat:
    """Template, tokenize and constrain one chat request (tools, ``tool_choice``, response
    format, sampling fields).

    Args:
        fe: the router's front end.
        req: the chat request (as sent, or translated from another API's).
        rid: the request id; arrival_ns: its arrival (monotonic ns).
        rename: a chat field's name -> the client's, for the fields the engine may name
            in an error (another API's words for them).

    Raises:
        OpenAIError: 400 naming the field for anything the request gets wrong. With a
            reasoning parser, an output constraint applies to the answer after the
            thinking (``reasoning.constrain_answer``).
    """
    tool_choice = await off_loop(req, req.tool_choice_spec)
    ids = render_chat(fe, req, tool_choice)
    constraint = await off_loop(
        req, lambda: req.constraint(tool_choice.constraint() if tool_choice else None))
    reasoning = fe.reasoning_mode(ids, req.chat_template_kwargs)
    constraint = constrain_answer(constraint, reasoning, fe.think_end_token_id)
    sp = req.to_sampling_params(num_prompt_tokens=len(ids), max_model_len=fe.max_model_len,
                                constraint=constraint, defaults=fe.sampling_defaults)
    fe.check_sampling_params(sp)
    param_of_field = dict(constraint.param_of_field)
    if tool_choice is not None and tool_choice.mode == "named":
        index = [t.name for t in tool_choice.tools].index(str(tool_choice.name))
        param_of_field = {f: f"tools[{index}].function.parameters" for f in param_of_field}
    elif tool_choice is not None and tool_choice.mode == "required":
        param_of_field = {f: "tools" for f in param_of_field}
    if rename is not None:
        param_of_field = {f: rename(param) for f, param in param_of_field.items()}
    gen = GenerationRequest(rid, ids, sp, req.priority, arrival_ns,
                            param_of_field=param_of_field, cache_salt=req.cache_salt)
    parses = tool_choice if tool_choice is not None and tool_choice.parses_calls else None
    return PreparedChat(gen, len(ids), parses, reasoning)


def render_chat(fe: Frontend, req: P.ChatCompletionRequest, tool_choice: ToolChoice | None
                ) -> list[int]:
    """The prompt token ids of a chat request: its messages (and tools, unless
    ``tool_choice`` is ``none``) through the chat template, as ``/tokenize`` counts them.

    Raises:
        OpenAIError: 400 naming the field (``Frontend.apply_chat_template``).
    """
    messages = [m.to_template() for m in req.messages]
    tools = ([t.to_template() for t in tool_choice.tools]
             if tool_choice is not None and tool_choice.render_tools else None)
    return fe.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message,
                                  kwargs=req.chat_template_kwargs, tools=tools)


def install(app: FastAPI, door: Door) -> None:
    """Add ``/v1/completions`` and ``/v1/chat/completions`` to ``app``."""
    fe, drain = door.fe, door.drain

    def reply(body: P.CompletionResponse | P.ChatCompletionResponse, rid: str,
              num_prompt_tokens: int, states: list[ChoiceState], n: int) -> JSONResponse:
        """The non-streamed answer ``body`` with the usage and timings of ``states``
        (``n`` choices per prompt)."""
        body.usage = usage(num_prompt_tokens, states, n)
        body.timings = timings_of(states)
        return JSONResponse(body.model_dump(mode="json"), headers={"X-Request-Id": rid})

    @app.post("/v1/completions", response_model=P.CompletionResponse,
              openapi_extra=openapi.request_body(P.CompletionRequest),
              responses={**openapi.GENERATION_ERRORS, **openapi.streamed(
                  "the completion; with `stream: true` server-sent events of "
                  "CompletionChunk objects, then `data: [DONE]`")})
    async def completions(request: Request) -> Response:
        rid, arrival_ns, req = await door.accept(request, P.CompletionRequest)
        prompts = fe.tokenize_prompts(req.prompt)
        constraint = await off_loop(req, req.constraint)
        gens = [_completion_request(fe, req, rid if len(prompts) == 1 else f"{rid}-p{p}", ids,
                                    arrival_ns, constraint)
                for p, ids in enumerate(prompts)]
        echo_texts = _echo_texts(fe, req, prompts)
        n = gens[0].sampling_params.n
        resp_id = f"cmpl-{rid}"
        num_prompt_tokens = sum(len(ids) for ids in prompts)
        if req.stream:
            return await stream(request, rid, door.generate(request, gens), CompletionStreamer(
                fe, req, resp_id, n, echo_texts, num_prompt_tokens, prompts), drain)
        states = await collect(request, rid, door.generate(request, gens), len(prompts) * n, drain)
        if states is None:
            return Response(status_code=CLIENT_GONE)
        choices = [completion_choice(fe, req, i, st, echo_texts[i // n], prompts[i // n])
                   for i, st in enumerate(states)]
        body = P.CompletionResponse(id=resp_id, model=req.model or fe.model_name,
                                    choices=choices)
        return reply(body, rid, num_prompt_tokens, states, n)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse,
              openapi_extra=openapi.request_body(P.ChatCompletionRequest),
              responses={**openapi.GENERATION_ERRORS, **openapi.streamed(
                  "the chat completion; with `stream: true` server-sent events of "
                  "ChatCompletionChunk objects, then `data: [DONE]`")})
    async def chat_completions(request: Request) -> Response:
        rid, arrival_ns, req = await door.accept(request, P.ChatCompletionRequest)
        chat = await prepare_chat(fe, req, rid, arrival_ns)
        resp_id = f"chatcmpl-{rid}"
        if req.stream:
            return await stream(request, rid, door.generate(request, [chat.gen]), ChatStreamer(
                fe, req, resp_id, chat.num_prompt_tokens, chat.parses, chat.reasoning), drain)
        n = chat.sampling_params.n
        states = await collect(request, rid, door.generate(request, [chat.gen]), n, drain)
        if states is None:
            return Response(status_code=CLIENT_GONE)
        choices = []
        for st in states:
            message, finish = chat_message(st.text, st.finish_reason, chat.parses,
                                           chat.reasoning)
            choices.append(P.ChatChoice(
                index=st.index, message=message,
                logprobs=chat_logprobs(fe, st.logprobs) if req.logprobs else None,
                finish_reason=finish, stop_reason=st.stop_reason))
        body = P.ChatCompletionResponse(id=resp_id, model=req.model or fe.model_name,
                                        choices=choices)
        if req.prompt_logprobs is not None and states:
            body.prompt_logprobs = vllm_prompt_logprobs(fe, states[0].prompt_logprobs)
        return reply(body, rid, chat.num_prompt_tokens, states, n)


def _completion_request(fe: Frontend, req: P.CompletionRequest, request_id: str,
                        ids: list[int], arrival_ns: int, constraint: Constraint
                        ) -> GenerationRequest:
    """The engine request of one prompt (token ids ``ids``) of a completion: its sampling
    parameters checked against the served model's limits.

    Raises:
        OpenAIError: 400 naming a parameter the model cannot serve
            (``Frontend.check_sampling_params``).
    """
    sp = req.to_sampling_params(num_prompt_tokens=len(ids), max_model_len=fe.max_model_len,
                                constraint=constraint, defaults=fe.sampling_defaults)
    fe.check_sampling_params(sp)
    return GenerationRequest(request_id, ids, sp, req.priority, arrival_ns,
                             param_of_field=constraint.param_of_field,
                             cache_salt=req.cache_salt)


def _echo_texts(fe: Frontend, req: P.CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text for ``echo`` (as sent; token-id prompts detokenized, only when
    ``echo`` is asked: otherwise only their count matters)."""
    if isinstance(req.prompt, str):
        return [req.prompt]
    if isinstance(req.prompt[0], str):
        return list(req.prompt)
    return [fe.tokenizer.decode(ids) if req.echo else "" for ids in prompts]


async def off_loop(req: P._SamplingRequest, check: Callable[[], _T]) -> _T:
    """Run ``check`` (building a request's constraint or tools: JSON-schema checks in pure
    Python, linear in the schema's size) on a worker thread when the request has such
    fields, so that one large schema does not stall every other request."""
    if not req.has_constraint_fields():
        return check()
    return await asyncio.to_thread(check)


def chat_message(text: str, finish_reason: str | None, tool_choice: ToolChoice | None,
                 reasoning_mode: ReasoningMode | None = None
                 ) -> tuple[P.ChatResponseMessage, str | None]:
    """A whole answer's message and finish reason: with a reasoning mode, the thinking
    split off into ``reasoning_content``; with tools, the calls parsed out of the rest."""
    reasoning = None
    if reasoning_mode is not None:
        reasoning, text = reasoning_mode.split(text)
    if tool_choice is None:
        return P.ChatResponseMessage(content=text if reasoning is None else text or None,
                                     reasoning_content=reasoning), finish_reason
    parser = ToolCallParser(tool_choice)
    first, rest = parser.feed(text), parser.finish()
    # The same rule as the streamed answer (ChatDeltaParser): no leading whitespace, and
    # no trailing whitespace beside calls.
    content = (first.content + rest.content).lstrip()
    calls = parser.calls
    if calls:
        content = content.rstrip()
    message = P.ChatResponseMessage(content=content or None, reasoning_content=reasoning,
                                    tool_calls=[c.to_openai() for c in calls] or None)
    return message, finish_reason_with_calls(finish_reason, bool(calls))


def timings_of(states: list[ChoiceState]) -> dict[str, Any] | None:
    """The ``timings`` of an answer: its first choice's (tandem's extension)."""
    t = states[0].timings if states else None
    return t.to_dict() if t is not None else None
