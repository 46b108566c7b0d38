"""Turning pipeline deltas into OpenAI response bodies and stream chunks.

Kept apart from the routes so that the shapes are in one place: completions use the legacy
parallel-list logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``),
chat uses ``logprobs.content`` entries with ``bytes`` and ``top_logprobs``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from tandem.services.router import protocol as P
from tandem.services.router.frontend import Frontend
from tandem.services.router.merge import merge_streams
from tandem.services.router.sequence import GenerationRequest, SeqDelta, Timings
from tandem.v1 import common_pb2


@dataclass
class ChoiceState:
    """Everything one choice produced (non-streaming), or its running offsets (streaming)."""

    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)
    text_offset: int = 0
    sent_role: bool = False
    timings: Timings | None = None
    #: prompt tokens the prefilling engine did not compute (sent on the first delta)
    num_cached_tokens: int = 0
    #: the prompt's logprobs when asked for (first delta), one per prompt token after the first
    prompt_logprobs: list[common_pb2.TopLogprobs] | None = None

    def add(self, d: SeqDelta) -> None:
        self.text += d.text
        self.num_tokens += len(d.token_ids)
        if d.num_cached_tokens:
            self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            self.timings = d.timings


async def merged(frontend: Frontend, requests: Sequence[GenerationRequest]
                 ) -> AsyncGenerator[tuple[int, SeqDelta], None]:
    """Deltas of several prompts' generations, with OpenAI choice indices (prompt * n + i).

    Closing this iterator closes (and so cancels) every generation.
    """
    async def indexed(p: int, req: GenerationRequest
                      ) -> AsyncGenerator[tuple[int, SeqDelta], None]:
        async with contextlib.aclosing(frontend.pipeline.generate(req)) as deltas:
            async for d in deltas:
                yield p * req.sampling_params.n + d.index, d

    streams = [indexed(p, r) for p, r in enumerate(requests)]
    async with contextlib.aclosing(merge_streams(streams)) as items:
        async for item in items:
            yield item


def usage(num_prompt_tokens: int, states: Sequence[ChoiceState], n: int) -> P.UsageInfo:
    """The ``usage`` of a request with ``num_prompt_tokens`` prompt tokens in all and the
    choices ``states`` (``n`` per prompt, in OpenAI index order: prompt * n + i).

    ``prompt_tokens_details.cached_tokens`` is always present (0 when nothing was
    cached), as in OpenAI's answers: per prompt, the count of its first choice (the
    ``n`` choices of one prompt share it), summed over the prompts.
    """
    num_completion_tokens = sum(s.num_tokens for s in states)
    num_cached = sum(s.num_cached_tokens for s in states[::n])
    return P.UsageInfo(
        prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=P.PromptTokensDetails(cached_tokens=num_cached))


def completion_logprobs(fe: Frontend, lps: Sequence[common_pb2.TopLogprobs], start_offset: int
                        ) -> P.CompletionLogprobs:
    """Legacy logprobs of generated tokens; ``text_offset`` counts from ``start_offset``."""
    out = P.CompletionLogprobs()
    offset = start_offset
    for lp in lps:
        tok = fe.token_text(lp.sampled.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.sampled.logprob)
        out.text_offset.append(offset)
        offset += len(tok)
        top: dict[str, float] = {}
        for t in lp.top:
            top.setdefault(fe.token_text(t.token_id), t.logprob)
        out.top_logprobs.append(top)
    return out


def chat_logprobs(fe: Frontend, lps: Sequence[common_pb2.TopLogprobs]) -> P.ChatLogprobs:
    content = []
    for lp in lps:
        tok = fe.token_text(lp.sampled.token_id)
        top = []
        for t in lp.top:
            text = fe.token_text(t.token_id)
            top.append(P.TopLogprob(token=text, logprob=t.logprob, bytes=list(text.encode())))
        content.append(P.ChatTokenLogprob(token=tok, logprob=lp.sampled.logprob,
                                          bytes=list(tok.encode()), top_logprobs=top))
    return P.ChatLogprobs(content=content)


def sse(obj: P.BaseModel | dict) -> str:
    """One server-sent event line pair."""
    data = obj.model_dump(mode="json") if isinstance(obj, P.BaseModel) else obj
    if data.get("timings", 0) is None:
        del data["timings"]
    for choice in data.get("choices") or ():
        delta = choice.get("delta")
        if delta is not None:  # as OpenAI: a delta holds only the fields it sets
            choice["delta"] = {k: v for k, v in delta.items() if v is not None}
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class SSETemplate:
    """The SSE text of one chunk shape that differs only in one string field, rendered
    once by :func:`sse` and filled in per chunk: ``render(text)`` equals ``sse`` of the
    same chunk with ``text`` in that field, without building and dumping the model per
    token (most of a streamed token's cost in the router).

    Made by :meth:`of` from the chunk's SSE text with :data:`MARK` in the field.
    """

    #: the placeholder put in the field (a control character: JSON escapes it, and no
    #: id, model name or fixed field of a chunk holds it)
    MARK = "\x00"
    _MARK_JSON = json.dumps(MARK)

    __slots__ = ("_head", "_tail")

    def __init__(self, head: str, tail: str) -> None:
        self._head = head
        self._tail = tail

    @classmethod
    def of(cls, text: str) -> SSETemplate | None:
        """The template of ``text`` (``sse`` of a chunk with :data:`MARK` in the field),
        or ``None`` when the placeholder is not there exactly once."""
        if text.count(cls._MARK_JSON) != 1:
            return None
        head, tail = text.split(cls._MARK_JSON)
        return cls(head, tail)

    def render(self, text: str) -> str:
        # json.dumps escapes a string as sse's json.dumps of the whole chunk does
        return self._head + json.dumps(text) + self._tail


DONE = "data: [DONE]\n\n"
