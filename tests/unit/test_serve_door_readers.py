"""`tandem bench serve`'s door readers on canned streams (the router's event shapes): which
events are token events, and where each door's usage is read from."""

from __future__ import annotations

import pytest

from tandem.bench.serve_client import RequestResult
from tandem.bench.serve_doors import DOORS, DoorError
from tandem.bench.serve_report import doors_table


def _read(door: str, events: list[dict]) -> tuple[list[str], RequestResult]:
    res = RequestResult(prompt_len=0)
    texts = [t for e in events if (t := DOORS[door].read(e, res)) is not None]
    return texts, res


def test_responses_reads_text_deltas_and_the_final_usage() -> None:
    resp = {"status": "in_progress", "usage": None}
    events = [
        {"type": "response.created", "response": resp},
        {"type": "response.in_progress", "response": resp},
        {"type": "response.output_item.added", "item": {}},
        {"type": "response.content_part.added", "part": {}},
        {"type": "response.output_text.delta", "delta": "Hel"},
        {"type": "response.output_text.delta", "delta": "lo"},
        {"type": "response.output_text.done", "text": "Hello"},
        {"type": "response.incomplete", "response": {
            "status": "incomplete", "usage": {"input_tokens": 21, "output_tokens": 2}}},
    ]
    texts, res = _read("responses", events)
    assert texts == ["Hel", "lo"]
    assert (res.prompt_len, res.output_tokens) == (21, 2)
    with pytest.raises(DoorError, match="boom"):
        _read("responses", [{"type": "error", "code": "x", "message": "boom"}])


def test_messages_reads_text_deltas_only_and_both_usages() -> None:
    events = [
        {"type": "message_start", "message": {"usage": {
            "input_tokens": 5, "output_tokens": 0, "cache_read_input_tokens": 16}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": "{"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
         "usage": {"output_tokens": 7}},
        {"type": "message_stop"},
    ]
    texts, res = _read("messages", events)
    assert texts == ["Hi"]
    assert (res.prompt_len, res.output_tokens) == (21, 7)  # computed + cached prompt tokens
    with pytest.raises(DoorError, match="overloaded"):
        _read("messages", [{"type": "error", "error": {"type": "x", "message": "overloaded"}}])


def test_chat_skips_the_role_and_finish_chunks() -> None:
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [{"delta": {"reasoning_content": "r"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}], "timings": {"x": 1}},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
    ]
    texts, res = _read("chat", events)
    assert texts == ["a", "r"]
    assert (res.prompt_len, res.output_tokens, res.timings) == (9, 2, {"x": 1})


def test_doors_bodies_carry_the_same_length_and_sampling() -> None:
    for name, door in DOORS.items():
        body = door.body("m", [1, 2] if door.takes_ids else "hi", 7, 0.0,
                         door.takes_ignore_eos)
        assert body["stream"] is True and body["temperature"] == 0.0, name
        length = {"completions": "max_tokens", "chat": "max_completion_tokens",
                  "responses": "max_output_tokens", "messages": "max_tokens"}[name]
        assert body[length] == 7, name
        assert body.get("ignore_eos", False) is door.takes_ignore_eos, name
    assert DOORS["responses"].body("m", "x", 1, 0.0, False)["store"] is False


def test_doors_table_compares_each_round_with_its_own_base_door() -> None:
    def m(door: str, tok_s: float) -> dict:
        return dict(endpoint_type=door, request_rate=2.0, total_output_tokens=64,
                    output_throughput=tok_s, median_ttft_ms=1.0, median_tpot_ms=1.0,
                    median_itl_ms=1.0, failed=0)

    rows = doors_table([m("chat", 10), m("messages", 9), m("messages", 20), m("chat", 25)],
                       "chat").splitlines()[2:]
    assert [r.split(" | ")[5] for r in rows] == ["1.000", "0.900", "0.800", "1.000"]
