"""The multi-turn workload's pieces without a server: its shape checks and per-turn table."""

from __future__ import annotations

import pytest

from tandem.bench.multiturn import MultiTurnShape, TurnResult, turn_metrics
from tandem.bench.serve import main


def test_shape_names_the_flag_of_a_bad_count() -> None:
    with pytest.raises(ValueError, match="--multi-turn-turns"):
        MultiTurnShape(2, 0, 10, 10, 10)
    with pytest.raises(ValueError, match="--multi-turn-system-len"):
        MultiTurnShape(2, 2, -1, 10, 10)
    assert main(["--dataset-name", "multi-turn", "--multi-turn-answer-len", "0"]) == 2


def test_turn_metrics_per_turn() -> None:
    results = [
        TurnResult(0, 1, success=True, ttft=0.2, prompt_tokens=100, cached_tokens=0,
                   timings={"disagg_decision": "remote_prefill",
                            "prefill_compute_ns": 150_000_000}),
        TurnResult(1, 1, success=True, ttft=0.4, prompt_tokens=100, cached_tokens=64,
                   timings={"prefill_compute_ns": 250_000_000}),
        TurnResult(0, 2, success=True, ttft=0.05, prompt_tokens=180, cached_tokens=160,
                   timings={"disagg_decision": "local_prefill"}),
        TurnResult(1, 2, success=False, error="HTTP 503"),
    ]
    m = turn_metrics(results, 1.0, [50, 90])
    assert (m["completed"], m["failed"], m["errors"]) == (3, 1, ["HTTP 503"])
    one, two = m["per_turn"]
    assert (one["turn"], one["completed"], one["failed"]) == (1, 2, 0)
    assert one["median_ttft_ms"] == pytest.approx(300)
    assert one["mean_cached_tokens"] == 32
    assert (two["completed"], two["failed"], two["local_prefill"]) == (1, 1, 1)
    assert two["median_ttft_ms"] == pytest.approx(50)
    # the TTFT parts: medians over the requests that report them, absent otherwise
    assert one["median_prefill_compute_ms"] == pytest.approx(200)
    assert "median_prefill_compute_ms" not in two
    # every turn's own counts, in the order sent (per-request diagnosis of cache misses)
    rows = m["requests"]
    assert [(r["conversation"], r["turn"], r["success"]) for r in rows] == [
        (0, 1, True), (1, 1, True), (0, 2, True), (1, 2, False)]
    assert (rows[2]["prompt_tokens"], rows[2]["cached_tokens"]) == (180, 160)
    assert rows[2]["ttft_ms"] == pytest.approx(50)


def test_answer_past_its_end_of_turn_retokenises_to_the_generated_ids() -> None:
    """An ``ignore_eos`` answer often runs past ``<|im_end|>`` into a made-up turn. The
    next turn's prompt must start with this turn's prompt + the generated ids (what the
    decode instance published), which holds only when the text keeps special tokens."""
    from tandem.bench.multiturn import chat_body
    from tandem.engine.model_files import load_tokenizer

    tok = load_tokenizer()

    def encode(messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        text = tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=generation_prompt)
        return list(tok.encode(text, add_special_tokens=False))

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    prompt = encode(messages, True)
    generated = list(tok.encode("Hello there.<|im_end|>\n<|im_start|>user\nAnd then more",
                                add_special_tokens=False))
    assert tok.convert_tokens_to_ids("<|im_end|>") in generated

    def next_prompt(skip_special_tokens: bool) -> list[int]:
        text = tok.decode(generated, skip_special_tokens=skip_special_tokens)
        return encode(messages + [{"role": "assistant", "content": text},
                                  {"role": "user", "content": "Next?"}], True)

    body = chat_body("m", messages, 16)
    assert body["ignore_eos"] is True
    history = prompt + generated
    assert next_prompt(body["skip_special_tokens"])[:len(history)] == history
    # the API's default drops the end-of-turn token: the chain breaks at it
    assert next_prompt(True)[:len(history)] != history


def test_plot_turns_writes_a_png_per_run_and_turn(tmp_path) -> None:
    from tandem.bench.multiturn import plot_turns

    def run(label: str, ttft: float, cached: int) -> dict:
        results = [TurnResult(c, t, success=True, ttft=ttft * t, prompt_tokens=100 * t,
                              cached_tokens=cached * t) for c in range(2) for t in (1, 2, 3)]
        return turn_metrics(results, 1.0, [50, 90]) | {"label": label}

    path = tmp_path / "turns.png"
    plot_turns([run("store tier", 0.1, 80), run("no reuse", 0.3, 50)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
