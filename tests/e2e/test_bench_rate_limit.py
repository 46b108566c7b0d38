"""``tandem bench rate-limit`` end to end: it starts redis, one colocated engine with the
tiny random-weight Llama (float32) and two routers sharing the Redis, drives eight clients
for a few seconds at a tenant limited to three requests per minute, and reports. The
report's shape, the limit holding over the run (all of it inside one minute), and the
routers' per-tenant counters equal to the client's own count are checked; no timing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tandem.bench import rate_limit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

REQUESTS_PER_MINUTE = 3
TOKENS_PER_MINUTE = 1000
CONCURRENCY = 8


def test_bench_rate_limit_counts_match_the_routers(tmp_path_factory) -> None:
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    out = tmp_path_factory.mktemp("bench_rate_limit") / "report.json"
    code = rate_limit.main([
        "--model", tiny, "--engine-arg=--dtype=float32", "--engine-arg=--num-kv-blocks=256",
        "--engine-arg=--max-model-len=256", "--replicas", "2",
        "--tokens-per-minute", str(TOKENS_PER_MINUTE),
        "--requests-per-minute", str(REQUESTS_PER_MINUTE),
        "--concurrency", str(CONCURRENCY), "--duration-s", "3", "--max-tokens", "4",
        "--json-out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"limits", "client", "sliding_windows", "fixed_minutes", "router",
                           "router_matches_client", "config"}
    assert report["config"]["replicas"] == 2
    client, router = report["client"], report["router"]
    assert client["errors"] == 0, client["error_samples"]
    # the first eight requests arrive together and the window admits three of them
    assert client["requests"] == REQUESTS_PER_MINUTE
    assert client["rate_limited"] >= CONCURRENCY - REQUESTS_PER_MINUTE
    assert client["tokens"] == client["prompt_tokens"] + client["completion_tokens"] > 0
    assert router["requests"] == client["requests"]
    assert router["tokens"] == client["tokens"]
    assert sum(router["rate_limited"].values()) == client["rate_limited"]
    assert set(router["rate_limited"]) == {"requests_per_minute"}
    assert report["router_matches_client"] == {"requests": True, "tokens": True,
                                               "rate_limited": True}
    # a run shorter than a minute has no whole sliding window and one partial minute
    assert report["sliding_windows"]["tokens"]["num_windows"] == 0
    assert report["sliding_windows"]["requests"]["max_any_window"] == REQUESTS_PER_MINUTE
    (minute,) = report["fixed_minutes"]
    assert minute["partial"] and minute["requests"] == REQUESTS_PER_MINUTE
    assert minute["tokens"] == client["tokens"]
    assert minute["rate_limited"] == client["rate_limited"]
