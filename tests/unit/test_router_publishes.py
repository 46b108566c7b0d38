"""The router's memory of output publishes that may still run (services/router/publishes.py):
which prompt gets a ``PublishInFlight`` hint, naming which blocks."""

from __future__ import annotations

import pytest

from tandem.contracts.block_hash import hash_token_blocks
from tandem.contracts.block_key import PublishInFlight
from tandem.services.router.publishes import PublishTracker

BS = 4
FP = b"f" * 16


def hashes_of(tokens: list[int]):
    return lambda bs: hash_token_blocks(tokens, bs)


def finish(tracker: PublishTracker, rid: str, prompt: list[int], output: list[int],
           first_block: int | None = None, instance: str = "decode-0") -> None:
    """What the pipeline records when ``rid`` finishes on a publishing decode instance."""
    tracker.record(rid, instance, FP, BS, hash_token_blocks(prompt, BS),
                   prompt + output[:-1],
                   len(prompt) // BS if first_block is None else first_block)


def test_a_next_turn_is_hinted_at_the_blocks_its_previous_answer_publishes() -> None:
    tracker = PublishTracker()
    prompt = list(range(10))  # blocks 0-1 full, 2 tokens in block 2
    answer = list(range(100, 112))  # KV for 21 tokens: blocks 2-4 are the publish's
    finish(tracker, "turn-1", prompt, answer)
    turn2 = prompt + answer + [7, 8, 9, 10, 11]
    assert tracker.find(hashes_of(turn2)) == PublishInFlight("turn-1", FP, BS, 2, 5)
    # A prompt that leaves the answer after its first block: only that block is named.
    diverged = prompt + answer[:3] + [55] * 12
    assert tracker.find(hashes_of(diverged)) == PublishInFlight("turn-1", FP, BS, 2, 3)
    # One that shares only the prompt, or nothing: no hint.
    assert tracker.find(hashes_of(prompt + [55] * 12)) is None
    assert tracker.find(hashes_of(list(range(50, 80)))) is None


def test_the_hint_names_the_publish_that_reaches_furthest() -> None:
    tracker = PublishTracker()
    turn1, answer1 = list(range(8)), list(range(100, 109))
    finish(tracker, "turn-1", turn1, answer1)
    turn2 = turn1 + answer1 + [1, 2, 3]
    answer2 = list(range(200, 209))
    finish(tracker, "turn-2", turn2, answer2)
    turn3 = turn2 + answer2 + [4, 5]
    hint = tracker.find(hashes_of(turn3))
    assert hint is not None and hint.request_id == "turn-2"
    assert (hint.first_block, hint.end_block) == (len(turn2) // BS, (len(turn2) + 8) // BS)
    # A colocated request computed its prompt too: its publish starts at block 0.
    other = PublishTracker()
    finish(other, "local", turn1, answer1, first_block=0)
    assert other.find(hashes_of(turn2)) == PublishInFlight("local", FP, BS, 0, 4)


def test_records_expire_are_bounded_and_skip_publishes_of_no_new_block() -> None:
    tracker = PublishTracker(ttl_s=1e-9)
    prompt, answer = list(range(8)), list(range(100, 109))
    finish(tracker, "old", prompt, answer)
    assert tracker.find(hashes_of(prompt + answer)) is None and len(tracker) == 0

    tracker = PublishTracker(max_records=2)
    for i in range(3):
        finish(tracker, f"r{i}", [i] * 8, list(range(100, 109)))
    assert len(tracker) == 2
    assert tracker.find(hashes_of([0] * 8 + list(range(100, 109)))) is None, "the oldest went"
    assert tracker.find(hashes_of([2] * 8 + list(range(100, 109)))) is not None

    short = PublishTracker()
    finish(short, "short", list(range(8)), [1, 2])  # 9 tokens of KV: no block past 2
    assert len(short) == 0


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0}, {"max_records": 0}])
def test_bad_settings_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PublishTracker(**kwargs)


@pytest.mark.parametrize(("args", "field"), [
    (("", FP, 4, 0, 1), "request_id"),
    (("r", b"", 4, 0, 1), "kv_layout_fingerprint"),
    (("r", FP, 0, 0, 1), "block_size"),
    (("r", FP, 4, -1, 1), "first_block"),
    (("r", FP, 4, 2, 2), "end_block"),
])
def test_a_bad_hint_names_its_field(args, field) -> None:
    with pytest.raises(ValueError, match=f"kv_publish_in_flight.{field}"):
        PublishInFlight(*args)


def test_publishes_from_the_same_first_block_do_not_forget_each_other() -> None:
    """Two chats that share a system prompt and whose turns were prefilled on the decode
    instance (first block 0: conditional disaggregation's local prefill) both start their
    publish at the system prompt's block 0. The tracker used to key records by that
    block's hash alone, so the second finish replaced the first, and the first chat's
    next turn was hinted at the other chat's publish (the shared blocks only, which are
    in the store already): its own answer's blocks were then recomputed."""
    tracker = PublishTracker()
    system = list(range(500, 508))  # two full blocks shared by both chats
    a_prompt, a_answer = system + [1, 2, 3], list(range(100, 110))
    b_prompt, b_answer = system + [4, 5, 6], list(range(200, 210))
    finish(tracker, "chat-a", a_prompt, a_answer, first_block=0)
    finish(tracker, "chat-b", b_prompt, b_answer, first_block=0)
    a_next = a_prompt + a_answer + [9, 9, 9, 9]
    assert tracker.find(hashes_of(a_next)) == PublishInFlight("chat-a", FP, BS, 0, 5)
    b_next = b_prompt + b_answer + [9, 9, 9, 9]
    assert tracker.find(hashes_of(b_next)) == PublishInFlight("chat-b", FP, BS, 0, 5)


def test_publishes_of_an_instance_that_is_down_are_not_hinted() -> None:
    """A decode that died right after its answer never writes the end marker: a hint of
    its publish would hold the next turn's lookup for the whole ``--kv-load-wait-s``.
    Its records are skipped while it is down; another instance's still count."""
    tracker = PublishTracker()
    turn1, answer1 = list(range(8)), list(range(100, 109))
    finish(tracker, "on-a", turn1, answer1, instance="a:1")
    finish(tracker, "on-b", list(range(50, 58)), answer1, instance="b:1")
    turn2 = turn1 + answer1 + [1, 2, 3]
    down = {"a:1"}
    assert tracker.find(hashes_of(turn2), lambda addr: addr in down) is None
    other_turn2 = list(range(50, 58)) + answer1 + [1, 2, 3]
    hint = tracker.find(hashes_of(other_turn2), lambda addr: addr in down)
    assert hint is not None and hint.request_id == "on-b"
    down.clear()  # back (its publish may have committed after all)
    hint = tracker.find(hashes_of(turn2), lambda addr: addr in down)
    assert hint is not None and hint.request_id == "on-a"
