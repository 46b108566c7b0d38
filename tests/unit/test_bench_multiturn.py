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
