"""Reasoning output: the thinking of ``<think>...</think>`` models split from their answer
(vLLM's ``--reasoning-parser``; its names ``deepseek_r1`` and ``qwen3``).

The thinking goes to ``reasoning_content`` in chat completions, to a ``reasoning`` item
in Responses and to ``thinking`` blocks in Anthropic Messages; the text after
``</think>`` is the answer, which alone goes through tool-call parsing.

Where the output starts:

* ``deepseek_r1``: in the thinking, whether or not the model writes ``<think>`` (DeepSeek-R1's
  template opens the tag in the prompt, so the output may hold only ``</think>``);
  an output that never closes it (cut by ``max_tokens``) is all thinking.
* ``qwen3``: in the answer, unless the output begins with ``<think>`` or the rendered
  prompt ends with an open ``<think>`` (templates that open it themselves);
  ``chat_template_kwargs: {"enable_thinking": false}`` turns the split off (the template
  then closes an empty thinking in the prompt, and the whole output is the answer).

Only a ``<think>`` before any other text opens the thinking, and only the first
``</think>`` closes it: tags later in the answer are the answer's text. The answer's
leading whitespace after ``</think>`` is dropped. Imports no torch (the router runs it).

Output constraints (``response_format``, ``structured_outputs``, ``guided_*``, forced tool
calls) apply to the answer only, as vLLM's: when the output starts in the thinking, the
constraint travels with ``after_token_id`` set to the ``</think>`` token
(:func:`constrain_answer`), and the engines apply the grammar from the token after it.
The model's tokenizer must hold ``</think>`` as one token (:func:`think_end_token_id`,
checked when the router starts). When the output starts in the answer (qwen3 without an
open ``<think>``), the grammar applies from the first token, which leaves no room for a
``<think>``: the whole output is the answer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.services.router.structured import Constraint

#: The parsers ``--reasoning-parser`` offers (vLLM's names).
REASONING_PARSERS = ("deepseek_r1", "qwen3")
_OPEN, _CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is split.

    Attributes:
        starts_in_reasoning: the output begins inside the thinking (no ``<think>`` needed).
    """

    starts_in_reasoning: bool

    def splitter(self) -> ReasoningSplitter:
        """A fresh splitter for one choice's text."""
        return ReasoningSplitter(self.starts_in_reasoning)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output -> ``(reasoning, answer)``; ``reasoning`` is ``None`` when the
        output holds no thinking (or an empty one)."""
        s = self.splitter()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return (r1 + r2) or None, c1 + c2


def reasoning_mode(parser: str | None, prompt_tail: str,
                   chat_template_kwargs: dict[str, Any] | None) -> ReasoningMode | None:
    """The split of one chat request's output, or ``None`` for none.

    Args:
        parser: ``--reasoning-parser`` (one of :data:`REASONING_PARSERS`), or ``None``.
        prompt_tail: the end of the rendered prompt's text (a few tokens decoded): an
            open ``<think>`` there means the template began the thinking.
        chat_template_kwargs: the request's, read for qwen3's ``enable_thinking``.

    Raises:
        ValueError: an unknown ``parser`` (the configuration checks it first).
    """
    if parser is None:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {REASONING_PARSERS}, got {parser!r}")
    if parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False:
        return None
    tail = prompt_tail.rstrip()
    opened = tail.endswith(_OPEN)
    return ReasoningMode(starts_in_reasoning=opened or parser == "deepseek_r1")


def think_end_token_id(tokenizer: Any) -> int:
    """The id of ``</think>`` in ``tokenizer`` (an HF tokenizer): the token after which a
    reasoning model's answer, and so its grammar, starts.

    Raises:
        ValueError: naming ``--reasoning-parser``, when the tokenizer encodes
            ``</think>`` as more than one token (the engines gate on one token id).
    """
    ids = tokenizer.encode(_CLOSE, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"--reasoning-parser: the model's tokenizer encodes {_CLOSE} as "
                         f"{len(ids)} tokens {ids}, not one; structured outputs could not "
                         "start after the thinking")
    return int(ids[0])


def constrain_answer(constraint: Constraint, mode: ReasoningMode | None,
                     end_token_id: int | None) -> Constraint:
    """``constraint`` for a request whose output ``mode`` splits: when the output starts
    in the thinking, its grammar starts after ``end_token_id`` (``</think>``); otherwise
    (no constraint, no split, output starting in the answer) as it is."""
    if constraint.params is None or mode is None or not mode.starts_in_reasoning:
        return constraint
    assert end_token_id is not None, "a reasoning parser resolves </think> at start-up"
    params = dataclasses.replace(constraint.params, after_token_id=end_token_id)
    return dataclasses.replace(constraint, params=params)


class ReasoningSplitter:
    """One choice's streamed text -> ``(reasoning, answer)`` pieces.

    A tag cut across deltas is held back until the text after it shows whether it is one,
    so the pieces never hold part of a tag; concatenated, they equal
    :meth:`ReasoningMode.split` of the whole text.
    """

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.in_reasoning = starts_in_reasoning
        self._may_open = True  # no text but whitespace seen yet: a <think> may come
        self._answer_started = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and answer text ``text`` completes (either may be empty)."""
        buf = self._held + text
        self._held = ""
        reasoning, answer = "", ""
        if self._may_open:
            stripped = buf.lstrip()
            if not stripped or _OPEN.startswith(stripped):
                self._held = buf
                return "", ""
            self._may_open = False
            if stripped.startswith(_OPEN):
                self.in_reasoning = True
                buf = stripped[len(_OPEN):]
        if self.in_reasoning:
            end = buf.find(_CLOSE)
            if end < 0:
                keep = _partial_suffix(buf, _CLOSE)
                self._held = buf[len(buf) - keep:] if keep else ""
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(_CLOSE):]
            self.in_reasoning = False
        if not self._answer_started:
            buf = buf.lstrip()
            self._answer_started = bool(buf)
        answer = buf
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the output: a partial tag is plain text then."""
        held, self._held = self._held, ""
        self._may_open = False
        if self.in_reasoning:
            return held, ""
        if not self._answer_started:
            held = held.lstrip()
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (0 when none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
