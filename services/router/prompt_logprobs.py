"""Prompt logprobs in the OpenAI answers: ``echo`` with ``logprobs`` on completions
(OpenAI's legacy form, what lm-evaluation-harness scores loglikelihood with) and vLLM's
``prompt_logprobs`` field on completions and chat.

The engine that computed the prompt (the prefill instance, or the decode instance on a
colocated or local prefill) sends one ``TopLogprobs`` per prompt token from the second
on (``sampled``: that prompt token with its logprob and rank; ``top``: the most likely
tokens there); the first prompt token has none. ``echo`` with ``max_tokens: 0``
answers the prompt alone: the engine samples one token, left out here (vLLM's way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.services.router import protocol as P
from tandem.services.router.frontend import Frontend
from tandem.services.router.responses import ChoiceState, completion_logprobs
from tandem.v1 import common_pb2

__all__ = ["completion_choice", "echo_logprobs", "extend_logprobs", "vllm_prompt_logprobs"]


def extend_logprobs(dst: P.CompletionLogprobs, src: P.CompletionLogprobs) -> None:
    """Append ``src``'s entries (tokens after ``dst``'s) to ``dst``, in place."""
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(dst, name).extend(getattr(src, name))


def vllm_prompt_logprobs(fe: Frontend, entries: Sequence[common_pb2.TopLogprobs] | None
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` answer field: ``None`` for the first prompt token, then
    per prompt token ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt
    token first, then the top alternatives (a prompt token among them appears once)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in entries or ():
        pos: dict[str, dict[str, Any]] = {}
        for t in (lp.sampled, *lp.top):
            pos.setdefault(str(t.token_id), {
                "logprob": t.logprob, "rank": t.rank if t.HasField("rank") else None,
                "decoded_token": fe.token_text(t.token_id)})
        out.append(pos)
    return out


def echo_logprobs(fe: Frontend, prompt_ids: Sequence[int],
                  entries: Sequence[common_pb2.TopLogprobs] | None) -> P.CompletionLogprobs:
    """The echoed prompt's legacy logprobs: every prompt token's text and ``text_offset``
    (from 0), ``token_logprobs`` and ``top_logprobs`` ``None`` for the first token.

    Raises:
        ValueError: naming ``prompt_logprobs`` when the engine sent fewer entries than
            the prompt has tokens after the first.
    """
    entries = list(entries or ())
    if len(entries) != len(prompt_ids) - 1:
        raise ValueError(f"prompt_logprobs: {len(entries)} entries for a prompt of "
                         f"{len(prompt_ids)} tokens")
    out = P.CompletionLogprobs()
    offset = 0
    for i, tok_id in enumerate(prompt_ids):
        tok = fe.token_text(tok_id)
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        if i == 0:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        lp = entries[i - 1]
        out.token_logprobs.append(lp.sampled.logprob)
        top: dict[str, float] = {}
        for t in lp.top:
            top.setdefault(fe.token_text(t.token_id), t.logprob)
        out.top_logprobs.append(top)
    return out


def completion_choice(fe: Frontend, req: P.CompletionRequest, index: int, st: ChoiceState,
                      echo_text: str, prompt_ids: Sequence[int]) -> P.CompletionChoice:
    """One non-streamed completions choice: the echoed prompt (``echo``) and the generated
    text, their legacy logprobs (``logprobs``: the prompt's first with ``echo``), and
    vLLM's ``prompt_logprobs`` when the engine computed them. With ``echo`` and
    ``max_tokens: 0`` the generated token is left out and ``st.num_tokens`` set to 0
    (usage counts no completion token)."""
    text = st.text
    if req.echo_only:
        text, st.num_tokens = "", 0
    lps = None
    if req.logprobs is not None:
        lps = P.CompletionLogprobs()
        if req.echo:
            lps = echo_logprobs(fe, prompt_ids, st.prompt_logprobs)
        if not req.echo_only:
            extend_logprobs(lps, completion_logprobs(fe, st.logprobs,
                                                     len(echo_text) if req.echo else 0))
    prompt_lps = None
    if req.num_prompt_logprobs() is not None:
        prompt_lps = vllm_prompt_logprobs(fe, st.prompt_logprobs)
    return P.CompletionChoice(index=index, text=(echo_text if req.echo else "") + text,
                              logprobs=lps, finish_reason=st.finish_reason,
                              stop_reason=st.stop_reason, prompt_logprobs=prompt_lps)
