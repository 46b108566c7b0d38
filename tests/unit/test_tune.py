"""`tandem tune`: the rate search and the coarse-to-fine search against a model of a stack
(the evaluator is the search's parameter, so the model is a legitimate seam), the budget
on a model clock, the errors of its options, and its outputs: the `tandem up` command
parsed by the real `tandem up` parser and the Helm values rendered by the real chart."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tandem.bench import tune, tune_output, tune_search
from tandem.bench.tune_search import (
    Budget,
    CandidateResult,
    RatePoint,
    RatePolicy,
    SearchResult,
    Slo,
    rate_search,
    search,
)
from tandem.bench.tune_space import (
    Candidate,
    Knobs,
    Space,
    Topology,
    cpu_topologies,
    default_candidate,
)

SLO = Slo(ttft_ms=1000, tpot_ms=100, percentile=90)


def model_point(rate: float, capacity: float) -> RatePoint:
    """A stack of ``capacity`` req/s: every request good up to it, none past it."""
    ok = rate <= capacity
    return RatePoint(rate=rate, goodput=rate if ok else 0.0, throughput=min(rate, capacity),
                     attainment=1.0 if ok else 0.0)


class ModelClock:
    """Seconds that pass only when the model stack says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def model_stacks(capacity: Callable[[Candidate], float], clock: ModelClock,
                 start_s: float = 20.0, run_s: float = 10.0, opened: list[Candidate] | None = None
                 ) -> tune_search.OpenCandidate:
    """open_candidate for the search: starting costs ``start_s``, each run ``run_s``."""
    @contextmanager
    def open_candidate(c: Candidate) -> Iterator[tune_search.Measure]:
        if opened is not None:
            opened.append(c)
        clock.now += start_s
        cap = capacity(c)
        if cap < 0:
            raise RuntimeError("stack did not start")

        def measure(rate: float) -> RatePoint:
            clock.now += run_s
            return model_point(rate, cap)

        yield measure

    return open_candidate


def _run_rates(capacity: float, start: float, floor: float = 0.0,
               policy: RatePolicy | None = None) -> list[RatePoint]:
    points: list[RatePoint] = []
    rate_search(lambda r: model_point(r, capacity), SLO, policy or RatePolicy(), start,
                lambda: None, points, floor, target=0.0)
    return points


def test_rate_search_steps_up_then_bisects() -> None:
    points = _run_rates(capacity=3.0, start=1.0)
    rates = [p.rate for p in points]
    assert rates[:3] == [1.0, 2.0, 4.0]
    assert rates[3] == pytest.approx(math.sqrt(8.0))  # held
    assert rates[4] == pytest.approx(math.sqrt(math.sqrt(8.0) * 4.0))  # broke
    best = CandidateResult(default_candidate(), points).best(SLO)
    assert best is not None and best.rate == pytest.approx(math.sqrt(8.0))


def test_rate_search_steps_down_from_a_rate_that_breaks() -> None:
    points = _run_rates(capacity=0.6, start=4.0, policy=RatePolicy(bisect_steps=1))
    assert [p.rate for p in points][:4] == [4.0, 2.0, 1.0, 0.5]
    assert len(points) == 5  # one bisection between 0.5 and 1
    assert CandidateResult(default_candidate(), points).score(SLO) == pytest.approx(0.5)


def test_rate_search_goes_no_lower_than_the_floor() -> None:
    points = _run_rates(capacity=0.3, start=4.0, floor=1.0)
    assert [p.rate for p in points] == [4.0, 2.0, 1.0]
    assert CandidateResult(default_candidate(), points).score(SLO) == 0.0


def test_rate_search_bisects_only_where_it_could_beat_the_target() -> None:
    points: list[RatePoint] = []
    rate_search(lambda r: model_point(r, 0.6), SLO, RatePolicy(), 2.0, lambda: None, points,
                floor=0.3, target=1.5)
    assert [p.rate for p in points] == [2.0, 1.0, 0.5]  # broke at 1.0 <= 1.5: no bisection


def test_rate_search_stops_climbing_at_a_plateau() -> None:
    def saturated(rate: float) -> RatePoint:  # the SLO holds, goodput stays at 2 req/s
        g = min(rate, 2.0)
        return RatePoint(rate=rate, goodput=g, throughput=g, attainment=1.0)

    points: list[RatePoint] = []
    rate_search(saturated, SLO, RatePolicy(), 1.0, lambda: None, points)
    assert [p.rate for p in points] == [1.0, 2.0, 4.0]


def _landscape(c: Candidate) -> float:
    """Capacity peaks on colocated x1 at mnbt=512, mns=32, chunk=256."""
    k = c.knobs
    base = 4.0 if c.topology.colocated and c.topology.replicas == 1 else 2.0
    penalty = (abs(math.log2(k.max_num_batched_tokens / 512))
               + abs(math.log2(k.max_num_seqs / 32))
               + abs(math.log2((k.long_prefill_token_threshold or 4096) / 256)))
    return base / (1.0 + 0.25 * penalty)


def test_search_finds_the_peak_without_the_full_grid() -> None:
    clock = ModelClock()
    opened: list[Candidate] = []
    space = Space(default=default_candidate(), topologies=cpu_topologies(2))
    result = search(space, model_stacks(_landscape, clock, opened=opened), SLO,
                    RatePolicy(bisect_steps=4), Budget(10**6, clock), log=lambda _: None)
    assert result.stopped == "done"
    assert opened[0] == default_candidate()
    assert len(set(opened)) == len(opened)  # nothing measured twice
    best = result.best()
    assert best is not None
    assert best.candidate == Candidate(Topology(colocated=True, replicas=1, cpus_per_engine=2),
                                       Knobs(512, 32, 256))
    grid = (len(space.topologies) * len(space.batched_tokens) * len(space.num_seqs)
            * len(space.chunk_sizes))
    assert len(opened) < grid / 4


def test_the_default_split_is_refined_when_it_scores_best() -> None:
    clock = ModelClock()
    opened: list[Candidate] = []
    default_split = default_candidate().topology

    def capacity(c: Candidate) -> float:  # the unpinned default split is the best one
        return 2.0 * _landscape(c) if c.topology == default_split else _landscape(c) / 4

    space = Space(default=default_candidate(), topologies=cpu_topologies(2))
    result = search(space, model_stacks(capacity, clock, opened=opened), SLO, RatePolicy(),
                    Budget(10**6, clock), refine_topologies=1, log=lambda _: None)
    best = result.best()
    assert best is not None and best.candidate.topology == default_split
    assert best.candidate.knobs != default_candidate().knobs


def test_budget_stops_the_search_between_runs() -> None:
    clock = ModelClock()
    space = Space(default=default_candidate(), topologies=cpu_topologies(2))
    budget = Budget(200.0, clock)
    result = search(space, model_stacks(_landscape, clock), SLO, RatePolicy(), budget,
                    log=lambda _: None)
    assert result.stopped == "budget"
    assert result.results[0].candidate == default_candidate()
    assert result.results[0].score(SLO) > 0
    assert clock.now <= 200.0  # every step charged before it ran fit


def test_confirmation_remeasures_default_then_best_within_the_budget() -> None:
    clock = ModelClock()
    space = Space(default=default_candidate(), topologies=cpu_topologies(2))
    result = search(space, model_stacks(_landscape, clock), SLO, RatePolicy(),
                    Budget(600.0, clock), confirm_share=0.2, log=lambda _: None)
    best = result.best()
    assert best is not None and best.candidate != default_candidate()
    assert [r.candidate for r in result.confirmation] == [default_candidate(), best.candidate]
    rate = best.best(SLO).rate  # type: ignore[union-attr]
    assert [r.points[0].rate for r in result.confirmation] == [rate, rate]
    assert clock.now <= 600.0  # the reserve (120 s) covers the two re-runs (60 s)
    assert "re-measured one after the other" in tune_output.verdict(result)


def test_a_candidate_that_fails_to_start_is_a_result() -> None:
    clock = ModelClock()
    broken = Topology(colocated=True, replicas=2, cpus_per_engine=1)
    space = Space(default=default_candidate(), topologies=(broken,))

    def capacity(c: Candidate) -> float:
        return -1.0 if c.topology == broken else 1.0

    result = search(space, model_stacks(capacity, clock), SLO, RatePolicy(),
                    Budget(10**6, clock), log=lambda _: None)
    failed = result.result(Candidate(broken, default_candidate().knobs))
    assert failed is not None and "did not start" in failed.error
    assert failed.score(SLO) == 0.0
    assert result.best() is not None and result.best().candidate == default_candidate()


def test_cpu_topologies_pin_within_the_cpus() -> None:
    for cpus in (1, 2, 3, 8):
        topos = cpu_topologies(cpus)
        assert topos[0] == Topology(colocated=True, replicas=1, cpus_per_engine=cpus)
        for t in topos:
            assert 1 <= t.num_engines * t.cpus_per_engine <= cpus
    assert Topology(colocated=False, prefill=1, decode=1, cpus_per_engine=1) in cpu_topologies(2)
    assert Topology(colocated=False, prefill=6, decode=2, cpus_per_engine=1) in cpu_topologies(8)


def test_neighbours_step_on_the_ladders_and_normalize_the_chunk() -> None:
    space = Space(default=default_candidate(), topologies=())
    c = Candidate(default_candidate().topology, Knobs(512, 32, 0))
    got = {n.knobs for n in space.neighbours(c, 1)}
    assert got == {Knobs(1024, 32, 0), Knobs(256, 32, 0), Knobs(512, 64, 0),
                   Knobs(512, 16, 0), Knobs(512, 32, 256)}  # chunk 1024 >= mnbt 512: no cap


@pytest.mark.parametrize(("text", "percentile", "flag"), [
    ("ttft500", 90.0, "--slo"),
    ("ttft=500,latency=3", 90.0, "--slo"),
    ("ttft=-5", 90.0, "--slo"),
    ("", 90.0, "--slo"),
    ("ttft=500", 0.0, "--slo-percentile"),
])
def test_slo_errors_name_the_flag(text: str, percentile: float, flag: str) -> None:
    with pytest.raises(ValueError, match=f"^{flag}"):
        tune.parse_slo(text, percentile)


def test_slo_parses_serve_syntax() -> None:
    assert tune.parse_slo("ttft=800,tpot=60", 99.0) == Slo(800.0, 60.0, None, 99.0)


@pytest.mark.parametrize("text", ["64", "64:0", "x:1", "64:0.8,"])
def test_input_len_mix_errors_name_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="^--input-len-mix"):
        tune.parse_input_len_mix(text)


def test_point_from_serve_metrics_counts_failed_requests_as_not_good() -> None:
    from tandem.bench.serve import RequestResult, compute_metrics

    def req(ttft_s: float, ok: bool = True) -> RequestResult:
        return RequestResult(prompt_len=8, success=ok, output_tokens=11, ttft=ttft_s,
                             latency=ttft_s + 0.5)  # TPOT 50 ms

    results = [req(0.2), req(0.4), req(1.5), req(0.0, ok=False)]
    m = compute_metrics(results, 2.0, [50.0, SLO.percentile], SLO.bounds_ms())
    p = tune.point_from_metrics(1.5, m, SLO)
    assert p.goodput == pytest.approx(1.0)  # 2 good requests in 2 s
    assert p.attainment == pytest.approx(0.5)  # of the 4 sent
    assert p.failed == 1 and not p.meets(SLO)
    assert p.tpot_ms == pytest.approx(50.0)


def test_runs_at_two_rates_differ_in_ids_not_lengths() -> None:
    w = tune.Workload(num_prompts=16, input_len=8, output_len=4,
                      input_len_mix=((32, 0.5), (256, 0.5)))
    a, b = tune.run_prompts(w, 5000, 1.0), tune.run_prompts(w, 5000, 2.0)
    assert [(len(p), o) for p, o in a] == [(len(p), o) for p, o in b]
    assert {len(p) for p, _ in a} == {32, 256}
    assert all(pa[:16] != pb[:16] for (pa, _), (pb, _) in zip(a, b, strict=True))


def test_trace_replays_the_recorded_lengths(tmp_path: Path) -> None:
    recorded = tmp_path / "serve.json"  # `tandem bench serve --json`: a failed request has 0
    recorded.write_text(json.dumps([{"input_lens": [64, 1024, 9], "output_lens": [32, 16, 0]}]))
    trace = tune.load_trace(str(recorded))
    assert trace == ((64, 32), (1024, 16))
    w = tune.Workload(num_prompts=3, input_len=1, output_len=1, trace=trace)
    assert [(len(p), o) for p, o in tune.run_prompts(w, 5000, 1.0)] == [(64, 32), (1024, 16),
                                                                        (64, 32)]


@pytest.mark.parametrize("text", ["", "{\"input_lens\": [1]}", "not json"])
def test_trace_errors_name_the_flag(tmp_path: Path, text: str) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(text)
    with pytest.raises(ValueError, match="^--trace"):
        tune.load_trace(str(bad))
    with pytest.raises(ValueError, match="^--trace"):
        tune.load_trace(str(tmp_path / "missing.json"))


def test_engine_arg_may_not_set_a_searched_knob() -> None:
    with pytest.raises(ValueError, match="--engine-arg --max-num-seqs=4"):
        tune.check_engine_args(["--dtype=bfloat16", "--max-num-seqs=4"])


def test_usage_error_exits_2_before_starting_anything(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    from tandem.cli import main

    assert main(["tune", "--slo", "ttft=abc"]) == 2
    assert "--slo" in capsys.readouterr().err


@pytest.mark.parametrize("candidate", [
    Candidate(Topology(colocated=True, replicas=2, cpus_per_engine=1), Knobs(512, 32, 256)),
    Candidate(Topology(colocated=False, prefill=1, decode=3, cpus_per_engine=2),
              Knobs(1024, 64, 0)),
])
def test_up_command_is_what_tandem_up_parses(candidate: Candidate) -> None:
    """The printed command starts the candidate: parsed by the real `tandem up` parser."""
    import shlex

    from tandem.up import build_parser, config_from_args

    cmd = tune_output.up_command(candidate, "/models/m", ["--dtype=bfloat16"])
    argv = shlex.split(cmd)
    assert argv[:2] == ["tandem", "up"]
    cfg = config_from_args(build_parser().parse_args(argv[2:]))
    t, k = candidate.topology, candidate.knobs
    assert cfg.colocated == t.colocated
    assert cfg.cpus_per_engine == t.cpus_per_engine
    assert (cfg.replicas if t.colocated else (cfg.num_prefill, cfg.num_decode)) == (
        t.replicas if t.colocated else (t.prefill, t.decode))
    assert cfg.model == "/models/m"
    assert cfg.engine_args == ["--dtype=bfloat16", *k.engine_args()]


def test_helm_values_render_through_the_chart() -> None:
    helm = pytest.importorskip("helm_python")
    import yaml
    from helm_support import CHART, flag_values, tandem_containers

    c = Candidate(Topology(colocated=False, prefill=1, decode=1, cpus_per_engine=1),
                  Knobs(512, 32, 256))
    values = tune_output.helm_values(c, ["--dtype=bfloat16"])
    assert yaml.safe_load(tune_output.to_yaml(values)) == values
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="demo", namespace="llm", is_install=True)
    docs = [d for path, text in files.items() if not path.endswith("NOTES.txt")
            for d in yaml.safe_load_all(text) if d]
    seen = []
    for role, container in tandem_containers(tuple(docs)):
        if role not in ("prefill", "decode"):
            continue
        seen.append(role)
        flags = flag_values(container)
        assert flags["--max-num-batched-tokens"] == "512"
        assert flags["--max-num-seqs"] == "32"
        assert flags["--long-prefill-token-threshold"] == "256"
        assert flags["--dtype"] == "bfloat16"
        assert flags["--device"] == "cpu"
        assert container["resources"]["requests"]["cpu"] == "1"
    assert sorted(seen) == ["decode", "prefill"]


def test_helm_snippet_of_a_colocated_best_is_the_best_disaggregated() -> None:
    coloc = Candidate(Topology(colocated=True, replicas=1, cpus_per_engine=2))
    disagg = Candidate(Topology(colocated=False, prefill=1, decode=1, cpus_per_engine=1))
    results = [CandidateResult(default_candidate(), [model_point(0.5, 1.0)]),
               CandidateResult(coloc, [model_point(2.0, 2.0)]),
               CandidateResult(disagg, [model_point(1.0, 1.0)])]
    result = SearchResult(SLO, default_candidate(), results, "done", 1.0)
    with pytest.raises(ValueError, match="colocated"):
        tune_output.helm_values(coloc, [])
    snippet = tune_output.helm_snippet(result, [])
    assert "best configuration is colocated" in snippet
    assert "cpu: \"1\"" in snippet  # the disaggregated one's values
    table = tune_output.frontier_table(result)
    assert table.splitlines()[2].startswith(f"| 1 | {coloc.label}")
    assert "4.00x the default's 0.500 req/s" in tune_output.verdict(result)
