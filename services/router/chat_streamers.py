"""The SSE chunks of OpenAI's streamed completions and chat completions.

A chat choice's first chunk carries the role together with the first token, and its
finish reason comes in a chunk of its own with an empty delta, as OpenAI's. With tools,
each choice's text goes through a ``ChatDeltaParser`` (content and tool-call entries),
which the other front doors (Responses, Messages) reuse for their own events.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from tandem.services.router import protocol as P
from tandem.services.router.frontend import Frontend
from tandem.services.router.prompt_logprobs import (
    echo_logprobs,
    extend_logprobs,
    vllm_prompt_logprobs,
)
from tandem.services.router.reasoning import ReasoningMode
from tandem.services.router.responses import (
    ChoiceState,
    SSETemplate,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage,
)
from tandem.services.router.sequence import SeqDelta
from tandem.services.router.streaming import Chunk, Streamer
from tandem.services.router.tools import ToolCallParser, ToolChoice, finish_reason_with_calls


class ChatPiece(NamedTuple):
    """What one delta adds to a chat choice (``None``: nothing of that kind)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict] | None
    finish_reason: str | None


class ChatDeltaParser:
    """One chat choice's deltas -> ``ChatPiece``s: reasoning, content, tool-call entries,
    finish reason.

    With a reasoning mode (``reasoning.ReasoningMode``), the thinking is split off first
    and only the answer after it is parsed for tool calls. Without tools (``tool_choice``
    ``None``) the answer is the content. With tools, the entries are OpenAI's streamed
    ``delta.tool_calls`` form: a call's first entry holds ``index``, ``id``, ``type`` and
    ``function.name`` (and maybe a first piece of ``function.arguments``), later ones
    ``{"index", "function": {"arguments": <more>}}``. Concatenated, the content equals
    ``chat_message``'s for the whole text.
    """

    def __init__(self, tool_choice: ToolChoice | None,
                 reasoning: ReasoningMode | None = None) -> None:
        self.parser = ToolCallParser(tool_choice) if tool_choice is not None else None
        self.splitter = reasoning.splitter() if reasoning is not None else None
        self._num_calls_sent = 0
        self._held_space = ""
        self._content_started = False

    def feed(self, d: SeqDelta) -> ChatPiece:
        """The reasoning, content, tool-call entries and finish reason ``d`` adds."""
        text, reasoning = d.text, None
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(d.text)
            if d.finish_reason is not None:
                more_reasoning, more_text = self.splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        parser = self.parser
        if parser is None:
            return ChatPiece(reasoning or None, text or None, None, d.finish_reason)
        named_before = parser.named_call is not None
        parsed = parser.feed(text)
        tail = parser.finish() if d.finish_reason is not None else None
        content = parsed.content + (tail.content if tail else "")
        calls = parsed.calls + (tail.calls if tail else [])
        entries: list[dict] = []
        if parsed.arguments:
            call = parser.named_call
            assert call is not None
            if named_before:
                entries.append({"index": 0, "function": {"arguments": parsed.arguments}})
            else:
                first = call.to_openai(0)
                first["function"]["arguments"] = parsed.arguments
                entries.append(first)
                self._num_calls_sent = 1
        for call in calls:
            entries.append(call.to_openai(self._num_calls_sent))
            self._num_calls_sent += 1
        # NOTE: trailing whitespace is held until text follows it, so the blank lines
        # around <tool_call> blocks do not end the content of an answer with calls, and
        # whitespace before the first text is dropped: the rule of chat_message.
        content = self._held_space + content
        body = content.rstrip()
        self._held_space, content = content[len(body):], body
        if d.finish_reason is not None and not parser.calls:
            content += self._held_space
        if not self._content_started:
            content = content.lstrip()
            self._content_started = bool(content)
        finish = finish_reason_with_calls(d.finish_reason, bool(parser.calls))
        return ChatPiece(reasoning or None, content or None, entries or None, finish)


class OpenAIStreamer(Streamer):
    """Builds the SSE chunks of one streamed OpenAI completions or chat request."""

    def __init__(self, fe: Frontend, req: P._SamplingRequest, resp_id: str, num_choices: int,
                 num_prompt_tokens: int, n: int) -> None:
        self.fe = fe
        self.req = req
        self.resp_id = resp_id
        self.created = int(time.time())
        self.model = req.model or fe.model_name
        self.states = [ChoiceState(index=i) for i in range(num_choices)]
        self.num_prompt_tokens = num_prompt_tokens
        self.n = n  # choices per prompt
        opts = req.stream_options
        self._continuous_usage = bool(opts is not None and opts.include_usage
                                      and opts.continuous_usage_stats)
        self._templates: dict[int, SSETemplate | None] = {}

    def chunks(self, idx: int, d: SeqDelta) -> list[Chunk]:
        raise NotImplementedError

    def _text_chunk(self, idx: int, text: str) -> str | None:
        """The SSE text of a chunk of choice ``idx`` that carries only ``text``, from
        its template (``SSETemplate``, made once per choice from ``_plain_chunk``), or
        ``None`` where the chunk needs more (running usage)."""
        if self._continuous_usage:
            return None
        if idx not in self._templates:
            self._templates[idx] = SSETemplate.of(sse(self._plain_chunk(idx,
                                                                         SSETemplate.MARK)))
        tpl = self._templates[idx]
        return tpl.render(text) if tpl is not None else None

    def _plain_chunk(self, idx: int, text: str) -> P.ChatCompletionChunk | P.CompletionChunk:
        """Choice ``idx``'s chunk with ``text`` and nothing else (not the first)."""
        raise NotImplementedError

    def _finish(self, chunk: P.ChatCompletionChunk | P.CompletionChunk, d: SeqDelta,
                last: bool = True) -> Chunk:
        """The chunk's SSE text, with running usage (``continuous_usage_stats``); a
        choice's ``last`` chunk of its final delta carries its timings."""
        if self._continuous_usage:
            chunk.usage = usage(self.num_prompt_tokens, self.states, self.n)
        if d.finish_reason is not None and last and d.timings is not None:
            chunk.timings = d.timings.to_dict()
        return sse(chunk)

    async def final(self) -> list[str]:
        if not self.req.include_usage:
            return []
        u = usage(self.num_prompt_tokens, self.states, self.n)
        return [sse(self._usage_chunk(u))]

    def _usage_chunk(self, u: P.UsageInfo) -> P.BaseModel:
        raise NotImplementedError


class ChatStreamer(OpenAIStreamer):
    """Chat chunks; with tools, each choice's text goes through a ``ToolCallParser`` and
    calls are sent as ``delta.tool_calls`` entries (``index``, then ``id``, ``type`` and
    ``function.name`` on a call's first entry, ``function.arguments`` in pieces), the
    shape the ``openai`` client's stream helpers assemble."""

    req: P.ChatCompletionRequest

    def __init__(self, fe: Frontend, req: P.ChatCompletionRequest, resp_id: str,
                 num_prompt_tokens: int, tool_choice: ToolChoice | None = None,
                 reasoning: ReasoningMode | None = None) -> None:
        super().__init__(fe, req, resp_id, req.n, num_prompt_tokens, req.n)
        self.parsers = ([ChatDeltaParser(tool_choice, reasoning) for _ in range(req.n)]
                        if tool_choice is not None or reasoning is not None else None)

    def chunks(self, idx: int, d: SeqDelta) -> list[Chunk]:
        st = self.states[idx]
        st.add(d)
        first = not st.sent_role
        content: str | None = d.text
        reasoning, tool_calls, finish = None, None, d.finish_reason
        if self.parsers is not None:
            reasoning, content, tool_calls, finish = self.parsers[idx].feed(d)
        lps = chat_logprobs(self.fe, d.logprobs) if self.req.logprobs and d.logprobs else None
        out: list[Chunk] = []
        if content and not (first or tool_calls or lps or reasoning):
            text = self._text_chunk(idx, content)
            if text is not None:
                out.append(text)
                content = None
        if content or tool_calls or first or lps or reasoning:
            st.sent_role = True
            out.append(self._finish(self._chunk(P.ChatStreamChoice(
                index=idx, delta=P.DeltaMessage(role="assistant" if first else None,
                                                content=content, reasoning_content=reasoning,
                                                tool_calls=tool_calls),
                logprobs=lps)), d, last=finish is None))
        if finish is not None:
            # NOTE: OpenAI sends the finish reason in a chunk of its own, with an empty
            # delta: the openai SDK's stream helpers fire the `.done` event of a choice's
            # last tool call only on a chunk after the one that carries that call.
            out.append(self._finish(self._chunk(P.ChatStreamChoice(
                index=idx, delta=P.DeltaMessage(), finish_reason=finish,
                stop_reason=d.stop_reason)), d))
        return out

    def _chunk(self, choice: P.ChatStreamChoice) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                     choices=[choice])

    def _usage_chunk(self, u: P.UsageInfo) -> P.BaseModel:
        return P.ChatCompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                     choices=[], usage=u)

    def _plain_chunk(self, idx: int, text: str) -> P.ChatCompletionChunk:
        return P.ChatCompletionChunk(
            id=self.resp_id, created=self.created, model=self.model,
            choices=[P.ChatStreamChoice(index=idx, delta=P.DeltaMessage(content=text))])


class CompletionStreamer(OpenAIStreamer):
    req: P.CompletionRequest

    def __init__(self, fe: Frontend, req: P.CompletionRequest, resp_id: str, n: int,
                 echo_texts: list[str], num_prompt_tokens: int,
                 prompts: list[list[int]] | None = None) -> None:
        super().__init__(fe, req, resp_id, n * len(echo_texts), num_prompt_tokens, n)
        self.echo_texts = echo_texts
        self.prompts = prompts or [[] for _ in echo_texts]

    def chunks(self, idx: int, d: SeqDelta) -> list[Chunk]:
        st = self.states[idx]
        first = not st.sent_role
        st.sent_role = True
        st.add(d)
        # echo with max_tokens 0: the engine's one token is not part of the answer
        text, gen_lps = ("", None) if self.req.echo_only else (d.text, d.logprobs)
        if self.req.echo_only:
            st.num_tokens = 0
        lps, prompt_lps = None, None
        if first and self.req.echo:
            text = self.echo_texts[idx // self.n] + text
            st.text_offset = len(self.echo_texts[idx // self.n])
            if self.req.logprobs is not None:
                lps = echo_logprobs(self.fe, self.prompts[idx // self.n], d.prompt_logprobs)
        if first and self.req.num_prompt_logprobs() is not None:
            prompt_lps = vllm_prompt_logprobs(self.fe, d.prompt_logprobs)
        if self.req.logprobs is not None and gen_lps:
            more = completion_logprobs(self.fe, gen_lps, st.text_offset)
            st.text_offset += sum(len(t) for t in more.tokens)
            if lps is None:
                lps = more
            else:
                extend_logprobs(lps, more)
        if not (text or d.finish_reason or lps or prompt_lps):
            return []
        if not (lps or d.finish_reason or prompt_lps):
            plain = self._text_chunk(idx, text)
            if plain is not None:
                return [plain]
        chunk = P.CompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                  choices=[P.CompletionChoice(
                                      index=idx, text=text, logprobs=lps,
                                      finish_reason=d.finish_reason,
                                      stop_reason=d.stop_reason, prompt_logprobs=prompt_lps)])
        return [self._finish(chunk, d)]

    def _usage_chunk(self, u: P.UsageInfo) -> P.BaseModel:
        return P.CompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                 choices=[], usage=u)

    def _plain_chunk(self, idx: int, text: str) -> P.CompletionChunk:
        return P.CompletionChunk(id=self.resp_id, created=self.created, model=self.model,
                                 choices=[P.CompletionChoice(index=idx, text=text)])
