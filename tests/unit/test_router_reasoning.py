"""The router's reasoning split (``services/router/reasoning.py``): thinking and answer of
``<think>`` models, whole and streamed with tags cut across deltas, and tool-call parsing
applied to the answer only (``ChatDeltaParser``, ``chat_message``)."""

from __future__ import annotations

import pytest

from tandem.engine.sampling_params import StructuredOutputsParams
from tandem.services.router.chat_streamers import ChatDeltaParser
from tandem.services.router.openai_routes import chat_message
from tandem.services.router.reasoning import (
    ReasoningMode,
    constrain_answer,
    reasoning_mode,
    think_end_token_id,
)
from tandem.services.router.sequence import SeqDelta
from tandem.services.router.structured import Constraint
from tandem.services.router.tools import Tool, ToolChoice

R1 = ReasoningMode(starts_in_reasoning=True)
QWEN = ReasoningMode(starts_in_reasoning=False)

CASES = [
    # (mode, output, reasoning, answer)
    (R1, "Let me see</think>\n\nYes.", "Let me see", "Yes."),
    (R1, "<think>Hmm</think>No.", "Hmm", "No."),
    (R1, "\n<think>\nHmm\n</think>No.", "\nHmm\n", "No."),
    (R1, "still thinking when cut", "still thinking when cut", ""),
    (R1, "a < b and </thin", "a < b and </thin", ""),
    (QWEN, "<think>\nHmm\n</think>\n\nYes.", "\nHmm\n", "Yes."),
    (QWEN, "Plain answer.", None, "Plain answer."),
    (QWEN, "  x <think>not thinking</think>", None, "x <think>not thinking</think>"),
    (QWEN, "<thin", None, "<thin"),
    (QWEN, "<think></think>Yes", None, "Yes"),
    (R1, "One</think>Two</think>", "One", "Two</think>"),
]


@pytest.mark.parametrize(("mode", "text", "reasoning", "answer"), CASES)
def test_whole_output_split(mode: ReasoningMode, text: str, reasoning: str | None,
                            answer: str) -> None:
    assert mode.split(text) == (reasoning, answer)


@pytest.mark.parametrize(("mode", "text", "reasoning", "answer"), CASES)
def test_streamed_split_equals_whole_at_every_cut(mode: ReasoningMode, text: str,
                                                  reasoning: str | None, answer: str) -> None:
    """Every way of cutting the text into three deltas (tags cut anywhere) gives the
    same pieces as the whole text, and no piece holds part of a tag."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            s = mode.splitter()
            pieces = [s.feed(p) for p in (text[:i], text[i:j], text[j:])] + [s.finish()]
            got_r = "".join(r for r, _ in pieces)
            got_a = "".join(a for _, a in pieces)
            assert (got_r or None, got_a) == (reasoning, answer), (i, j)
            if reasoning is not None:
                assert not any("</" in r and r.endswith("</") for r, _ in pieces[:-1])


def test_tag_split_token_by_token_holds_back_until_known() -> None:
    s = R1.splitter()
    assert s.feed("Let me see") == ("Let me see", "")
    assert s.feed("</") == ("", "")
    assert s.feed("think") == ("", "")
    assert s.feed(">") == ("", "")
    assert s.feed("Yes") == ("", "Yes")
    assert s.finish() == ("", "")


def test_a_partial_close_tag_that_is_not_one_is_reasoning() -> None:
    s = R1.splitter()
    assert s.feed("x </") == ("x ", "")
    assert s.feed("b>") == ("</b>", "")


def test_mode_per_parser_prompt_and_enable_thinking() -> None:
    assert reasoning_mode(None, "", None) is None
    assert reasoning_mode("deepseek_r1", "assistant\n", None) == R1
    assert reasoning_mode("qwen3", "assistant\n", None) == QWEN
    # a template that opens the thinking itself
    assert reasoning_mode("qwen3", "<|im_start|>assistant\n<think>\n", None) == R1
    assert reasoning_mode("qwen3", "x", {"enable_thinking": False}) is None
    assert reasoning_mode("qwen3", "x", {"enable_thinking": True}) == QWEN
    with pytest.raises(ValueError, match="reasoning parser"):
        reasoning_mode("granite", "", None)


def test_a_constraint_starts_after_the_thinking_only_when_the_output_starts_in_it() -> None:
    so = StructuredOutputsParams(regex="[0-9]+")
    c = Constraint(params=so, param="structured_outputs.regex")
    got = constrain_answer(c, R1, 7)
    assert got.params == StructuredOutputsParams(regex="[0-9]+", after_token_id=7)
    assert got.param == "structured_outputs.regex"
    assert constrain_answer(c, QWEN, 7) is c  # the output starts in the answer
    assert constrain_answer(c, None, None) is c
    assert constrain_answer(Constraint(), R1, 7) == Constraint()


class _Tokenizer:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert text == "</think>" and not add_special_tokens
        return self.ids


def test_think_end_must_be_one_token() -> None:
    assert think_end_token_id(_Tokenizer([151668])) == 151668
    with pytest.raises(ValueError, match="--reasoning-parser.*3 tokens"):
        think_end_token_id(_Tokenizer([1, 2, 3]))


TOOLS = ToolChoice((Tool("get_weather", None, {"type": "object"}),), "auto")
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _feed(parser: ChatDeltaParser, pieces: list[str]) -> list:
    out = []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(parser.feed(SeqDelta(index=0, text=p, token_ids=[0],
                                        finish_reason="stop" if last else None)))
    return out


def test_tool_calls_are_parsed_from_the_answer_only() -> None:
    """A <tool_call> inside the thinking stays thinking; the one after </think> is a call."""
    text = f"maybe {CALL}?</think>Calling.{CALL}"
    message, finish = chat_message(text, "stop", TOOLS, R1)
    assert message.reasoning_content == f"maybe {CALL}?"
    assert message.content == "Calling."
    assert [c["function"]["name"] for c in message.tool_calls or ()] == ["get_weather"]
    assert finish == "tool_calls"
    # streamed character by character: the same split
    pieces = _feed(ChatDeltaParser(TOOLS, R1), list(text))
    assert "".join(p.reasoning or "" for p in pieces) == message.reasoning_content
    assert "".join(p.content or "" for p in pieces) == message.content
    calls = [e for p in pieces for e in p.tool_calls or ()]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(e["function"].get("arguments", "") for e in calls) == '{"city": "Oslo"}'
    assert pieces[-1].finish_reason == "tool_calls"


def test_without_tools_the_stream_splits_and_concatenates() -> None:
    pieces = _feed(ChatDeltaParser(None, R1), ["Hm", "m</th", "ink>", "\n\n", "Yes", "."])
    assert [(p.reasoning, p.content) for p in pieces] == [
        ("Hm", None), ("m", None), (None, None), (None, None), (None, "Yes"), (None, ".")]
    message, _ = chat_message("Hmm</think>\n\nYes.", "stop", None, R1)
    assert (message.reasoning_content, message.content) == ("Hmm", "Yes.")


def test_truncated_thinking_has_no_content() -> None:
    message, finish = chat_message("still thinking", "length", None, R1)
    assert (message.reasoning_content, message.content, finish) == (
        "still thinking", None, "length")
    pieces = _feed(ChatDeltaParser(None, R1), ["still ", "thinking </"])
    assert "".join(p.reasoning or "" for p in pieces) == "still thinking </"


def test_flag_is_validated_and_read() -> None:
    from tandem.services.router.config import RouterConfig
    from tandem.services.router.main import build_parser

    ns = build_parser().parse_args(["--colocated", "h:1", "--reasoning-parser", "qwen3"])
    assert RouterConfig.from_args(ns, {}).reasoning_parser == "qwen3"
    ns = build_parser().parse_args(["--colocated", "h:1"])
    assert RouterConfig.from_args(ns, {}).reasoning_parser is None
    with pytest.raises(ValueError, match="--reasoning-parser"):
        RouterConfig(colocated=("h:1",), reasoning_parser="granite")
