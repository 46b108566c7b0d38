"""The search of `tandem tune`: candidate configurations, the SLO, the per-candidate rate
search and the coarse-to-fine search over configurations, within a time budget.

No process is started here: a candidate is measured through ``open_candidate`` (a
parameter), which bench/tune.py backs with a real stack and ``tandem bench serve``'s
load functions. Rules:

- a request is *good* when it meets every bound of the SLO (vLLM's goodput definition,
  counted by ``tandem.bench.serve.compute_metrics``); a load *meets the SLO* at percentile
  P when at least P% of its requests are good (DistServe's SLO attainment);
- a candidate's score is its highest goodput (good requests/s) at a request rate that
  meets the SLO, 0 when none does;
- rates: from a start rate, up by ``factor`` while the SLO holds (down while it does
  not), then geometric bisection between the last rate that held and the first that
  broke (vLLM's auto_tune searches the rate the same way, for one latency bound);
- configurations: the default first (the baseline), then every split of the resources
  at the default candidate's knobs (coarse), then, for the best splits, coordinate steps of
  the knobs on their ladders, two rungs at a time and then one (fine).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.tune_space import (
    KNOB_FIELDS,
    Candidate,
    Space,
)


@dataclass(frozen=True)
class Slo:
    """Latency bounds of one request (ms; ``None``: unbounded) and the share of requests
    that must meet them.

    Attributes:
        percentile: a load meets the SLO when at least this percent of its requests are
            good (meet every bound).
    """

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None:
            raise ValueError("--slo: give at least one bound, e.g. ttft=2000,tpot=100")
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--slo: {name[:-3]} must be > 0 ms, got {v:g}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"--slo-percentile must be in (0, 100], got {self.percentile:g}")

    def bounds_ms(self) -> dict[str, float]:
        """The bounds as ``tandem bench serve``'s SLO dict (``compute_metrics``' ``slo_ms``)."""
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                  ("e2el", self.e2el_ms)) if v is not None}

    @property
    def label(self) -> str:
        bounds = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in self.bounds_ms().items())
        return f"{bounds} for {self.percentile:g}% of requests"


@dataclass(frozen=True)
class RatePoint:
    """One load run at one request rate.

    Attributes:
        rate: request rate offered (req/s).
        goodput: good requests per second of the run.
        throughput: completed requests per second.
        attainment: share of the requests sent that were good (failed ones are not).
        output_throughput: generated tokens per second.
        ttft_ms / tpot_ms: TTFT and TPOT at the SLO's percentile (ms).
        failed: requests that failed.
        duration_s: wall time of the run.
    """

    rate: float
    goodput: float
    throughput: float
    attainment: float
    output_throughput: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    failed: int = 0
    duration_s: float = 0.0

    def meets(self, slo: Slo) -> bool:
        """Whether at least ``slo.percentile`` percent of the requests were good."""
        return self.attainment * 100.0 >= slo.percentile - 1e-9


@dataclass
class CandidateResult:
    """The rate search of one candidate.

    Attributes:
        points: every run, in the order run.
        error: why the candidate could not be measured (its stack did not start...).
        complete: False when the budget ended the rate search early.
        wall_s: wall time spent on it, start-up included.
    """

    candidate: Candidate
    points: list[RatePoint] = field(default_factory=list)
    error: str = ""
    complete: bool = True
    wall_s: float = 0.0

    def best(self, slo: Slo) -> RatePoint | None:
        """The run with the highest goodput among those meeting the SLO."""
        ok = [p for p in self.points if p.meets(slo)]
        return max(ok, key=lambda p: p.goodput) if ok else None

    def score(self, slo: Slo) -> float:
        """Highest goodput meeting the SLO (req/s), 0 when none."""
        b = self.best(slo)
        return b.goodput if b is not None else 0.0


# ---- budget -------------------------------------------------------------------------------


class OutOfBudget(Exception):
    """The next step would not fit in the time left."""


class Budget:
    """Wall-clock budget of a search.

    ``charge`` is called before a step with its estimated cost; it raises
    :class:`OutOfBudget` when the estimate does not fit in what is left, so the search
    stops between steps with what it has measured.

    Args:
        total_s: seconds the whole search may take.
        clock: seconds, monotonic (``time.monotonic``; a model clock in tests).
    """

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not total_s > 0:
            raise ValueError(f"--budget must be > 0 minutes, got {total_s / 60:g}")
        self.total_s = total_s
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def remaining(self) -> float:
        return self.total_s - self.elapsed()

    def charge(self, estimate_s: float) -> None:
        """Raise :class:`OutOfBudget` unless ``estimate_s`` seconds fit in what is left."""
        if self.remaining() <= 0 or estimate_s > self.remaining():
            raise OutOfBudget


# ---- the searches -------------------------------------------------------------------------


@dataclass(frozen=True)
class RatePolicy:
    """How the request rate of one candidate is searched (req/s).

    Attributes:
        start: first rate of the first candidate (later ones start at the best rate
            found so far, where the comparison is decided).
        factor: step up or down while the SLO holds or breaks.
        bisect_steps: geometric bisections between the last rate that held and the
            first that broke.
        plateau_gain: stepping up stops when the goodput grew by less than this
            fraction (saturated).
    """

    start: float = 1.0
    factor: float = 2.0
    bisect_steps: int = 2
    plateau_gain: float = 0.05
    min_rate: float = 0.05
    max_rate: float = 256.0

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start <= self.max_rate:
            raise ValueError("--start-rate must be within [--min-rate, max_rate] "
                             f"([{self.min_rate:g}, {self.max_rate:g}]), got {self.start:g}")
        if not self.factor > 1:
            raise ValueError(f"--rate-factor must be > 1, got {self.factor:g}")
        if self.bisect_steps < 0:
            raise ValueError(f"--bisect-steps must be >= 0, got {self.bisect_steps}")


Measure = Callable[[float], RatePoint]
#: Starts a candidate (e.g. its stack) and yields its measure function; leaving the
#: context stops it. Raising (not OutOfBudget) marks the candidate failed.
OpenCandidate = Callable[[Candidate], AbstractContextManager[Measure]]


def rate_search(measure: Measure, slo: Slo, policy: RatePolicy, start: float,
                charge: Callable[[], None], points: list[RatePoint], floor: float = 0.0,
                target: float = 0.0) -> None:
    """Find the highest rate meeting ``slo``: step by ``policy.factor`` from ``start``
    until the SLO flips, then bisect. Appends each run to ``points``.

    Stepping up stops early at a plateau: a rate that meets the SLO with a goodput
    less than ``policy.plateau_gain`` above the last one (the stack is saturated; a higher
    offered rate only queues more). Stepping down stops below ``floor`` (req/s): a
    candidate that cannot meet the SLO there cannot win, so its exact rate is not needed.
    Nor is the bisection when the SLO broke at a rate at or below ``target`` (the best
    goodput so far, req/s): a run's goodput is about its offered rate at most.
    ``charge()`` runs before each run (it raises :class:`OutOfBudget` to stop).
    """
    def run(rate: float) -> RatePoint:
        charge()
        p = measure(rate)
        points.append(p)
        return p

    lowest = max(policy.min_rate, floor)
    rate = min(max(start, lowest), policy.max_rate)
    lo: float | None = None  # highest rate that held
    hi: float | None = None  # lowest rate that broke
    p = run(rate)
    if p.meets(slo):
        lo, good = rate, p.goodput
        while hi is None and rate * policy.factor <= policy.max_rate:
            rate *= policy.factor
            p = run(rate)
            if not p.meets(slo):
                hi = rate
            elif p.goodput < good * (1.0 + policy.plateau_gain):
                return
            else:
                lo, good = rate, p.goodput
    else:
        hi = rate
        while lo is None and rate / policy.factor >= lowest:
            rate /= policy.factor
            if run(rate).meets(slo):
                lo = rate
            else:
                hi = rate
    if lo is None or hi is None or hi <= target:
        return
    for _ in range(policy.bisect_steps):
        mid = math.sqrt(lo * hi)
        if run(mid).meets(slo):
            lo = mid
        else:
            hi = mid


@dataclass
class SearchResult:
    """Every candidate measured, in order, and why the search ended.

    Attributes:
        stopped: ``"done"`` (nothing left to try), ``"budget"`` or ``"interrupted"``.
        confirmation: the default and the best re-measured at the end, one after the
            other at the best's rate (one run each; empty when not done).
    """

    slo: Slo
    default: Candidate
    results: list[CandidateResult]
    stopped: str
    elapsed_s: float
    confirmation: list[CandidateResult] = field(default_factory=list)

    def result(self, c: Candidate) -> CandidateResult | None:
        return next((r for r in self.results if r.candidate == c), None)

    def ranked(self) -> list[CandidateResult]:
        """Candidates by score, best first (ties: the one measured first)."""
        return sorted(self.results, key=lambda r: -r.score(self.slo))

    def best(self) -> CandidateResult | None:
        """The highest-scoring candidate (None when none met the SLO)."""
        ranked = self.ranked()
        return ranked[0] if ranked and ranked[0].score(self.slo) > 0 else None


def search(space: Space, open_candidate: OpenCandidate, slo: Slo, policy: RatePolicy,
           budget: Budget, refine_topologies: int = 2, min_gain: float = 0.0,
           confirm_share: float = 0.0, log: Callable[[str], None] = print) -> SearchResult:
    """Coarse-to-fine search for the candidate with the highest goodput meeting ``slo``.

    Order: ``space.default``; every topology at the default's knobs; then for the
    ``refine_topologies`` best topologies (the default's among them), coordinate steps on the knob ladders (two
    rungs, then one) from that topology's best candidate, moving to a neighbour whose
    score beats the current one by more than ``min_gain`` (a fraction). A candidate is
    started only when the mean wall time of those before fits in the budget; the rate
    search stops when its runs' mean no longer fits; a candidate's rates go no lower
    than the best score so far over ``policy.factor`` squared, and it is bisected only
    where it could beat that score (``rate_search``'s ``target``). Measured candidates are
    never measured again. Ctrl-C (KeyboardInterrupt) ends the search like the budget.

    With ``confirm_share`` > 0 that share of the budget is kept for the end: the default
    and the best candidate are started again, one after the other, and run once each at
    the best's rate, so the two are compared close in time (a shared host's speed drifts
    over a search).
    """
    results: dict[Candidate, CandidateResult] = {}
    order: list[CandidateResult] = []
    run_times: list[float] = []
    best_rate = [policy.start]
    reserve = [budget.total_s * confirm_share]

    def charge_candidate() -> None:
        walls = [r.wall_s for r in order if r.points]
        budget.charge((sum(walls) / len(walls) if walls else 0.0) + reserve[0])

    def charge_run() -> None:
        budget.charge((sum(run_times) / len(run_times) if run_times else 0.0) + reserve[0])

    def evaluate(c: Candidate) -> CandidateResult:
        if c in results:
            return results[c]
        charge_candidate()
        res = CandidateResult(c)
        results[c] = res
        order.append(res)
        log(f"[tune {budget.elapsed() / 60:5.1f} min] {c.label}")
        t0 = budget.elapsed()
        points: list[RatePoint] = []
        res.points = points

        try:
            target = max((r.score(slo) for r in order), default=0.0)
            with open_candidate(c) as measure:
                rate_search(_timed(measure, budget, run_times, slo, log), slo, policy, best_rate[0], charge_run, points,
                            target / policy.factor ** 2, target)
        except OutOfBudget:
            res.complete = False
            raise
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is a result
            res.error = f"{type(exc).__name__}: {exc}"
            log(f"    failed: {res.error}")
        finally:
            res.wall_s = budget.elapsed() - t0
            b = res.best(slo)
            if b is not None and b.goodput >= max(r.score(slo) for r in order):
                best_rate[0] = b.rate
        return res

    stopped = "done"
    try:
        _explore(space, evaluate, order, slo, refine_topologies, min_gain)
    except OutOfBudget:
        stopped = "budget"
        log(f"[tune {budget.elapsed() / 60:5.1f} min] budget spent: stopping")
    except KeyboardInterrupt:
        stopped = "interrupted"
        log(f"[tune {budget.elapsed() / 60:5.1f} min] interrupted: stopping")
    result = SearchResult(slo, space.default, order, stopped, budget.elapsed())
    if confirm_share > 0 and stopped != "interrupted":
        _confirm(result, space, open_candidate, slo, budget, log)
    return result


def _timed(measure: Measure, budget: Budget, run_times: list[float], slo: Slo,
           log: Callable[[str], None]) -> Measure:
    """``measure`` that records each run's wall time in ``run_times`` and logs its point."""
    def run(rate: float) -> RatePoint:
        t = budget.elapsed()
        p = measure(rate)
        run_times.append(budget.elapsed() - t)
        log(f"    rate {rate:7.3f} req/s: goodput {p.goodput:6.3f} req/s, "
            f"{p.attainment * 100:5.1f}% good, p{slo.percentile:g} TTFT "
            f"{p.ttft_ms:8.1f} ms, TPOT {p.tpot_ms:7.1f} ms"
            f"{'' if p.meets(slo) else '  (SLO broken)'}")
        return p
    return run


def _explore(space: Space, evaluate: Callable[[Candidate], CandidateResult],
             order: list[CandidateResult], slo: Slo, refine_topologies: int,
             min_gain: float) -> None:
    """The search's order (``search``'s docstring): the default, every topology at the
    default's knobs, then coordinate walks from the best topologies' best candidates
    (``order``: every candidate measured so far, which ``evaluate`` extends).

    Raises:
        OutOfBudget / KeyboardInterrupt: from ``evaluate``; the search ends there.
    """
    evaluate(space.default)
    default_knobs = space.default.knobs
    for t in space.topologies:
        evaluate(Candidate(t, default_knobs))
    # NOTE: the default's split competes too (it may be none of the pinned ones).
    splits = list(dict.fromkeys([space.default.topology, *space.topologies]))
    by_topology = sorted(splits, key=lambda t: -evaluate(Candidate(t, default_knobs)).score(slo))
    for t in by_topology[:refine_topologies]:
        best = max((r for r in order if r.candidate.topology == t), key=lambda r: r.score(slo))
        if best.score(slo) <= 0:
            continue  # no foothold: nothing met the SLO on this split
        current = best.candidate
        for step in (2, 1):
            for c in _coordinate_walk(space, current, step, evaluate, slo, min_gain):
                current = c


def _confirm(result: SearchResult, space: Space, open_candidate: OpenCandidate, slo: Slo,
             budget: Budget, log: Callable[[str], None]) -> None:
    """The confirmation (``search``'s ``confirm_share``): the default and the best
    candidate started again, one after the other, each run once at the best's rate;
    appended to ``result.confirmation``. Nothing when the default is the best, or none
    met the SLO. The budget or Ctrl-C cut it short (logged)."""
    best = result.best()
    if best is None or best.candidate == space.default:
        return
    rate = best.best(slo).rate  # type: ignore[union-attr]  # best() has a best run
    log(f"[tune {budget.elapsed() / 60:5.1f} min] confirming at {rate:.3f} req/s: "
        "the default, then the best")
    try:
        for c in (space.default, best.candidate):
            budget.charge(0.0)
            res = CandidateResult(c)
            try:
                with open_candidate(c) as measure:
                    res.points.append(measure(rate))
            except Exception as exc:  # noqa: BLE001 - reported, as in the search
                res.error = f"{type(exc).__name__}: {exc}"
            result.confirmation.append(res)
    except (OutOfBudget, KeyboardInterrupt):
        log(f"[tune {budget.elapsed() / 60:5.1f} min] confirmation cut short")
    result.elapsed_s = budget.elapsed()


def _coordinate_walk(space: Space, start: Candidate, step: int,
                     evaluate: Callable[[Candidate], CandidateResult], slo: Slo,
                     min_gain: float) -> Iterator[Candidate]:
    """From ``start``, move to the first neighbour (``step`` rungs away) that beats the
    current score by more than ``min_gain``; yields each move, ends at a local best."""
    current = start
    score = evaluate(current).score(slo)
    moved = True
    while moved:
        moved = False
        for n in space.neighbours(current, step):
            s = evaluate(n).score(slo)
            if s > score * (1.0 + min_gain):
                current, score, moved = n, s, True
                yield current
                break


def summary(r: CandidateResult, slo: Slo) -> dict[str, Any]:
    """A candidate's JSON entry: its configuration, score, best run and every run."""
    b = r.best(slo)
    t, k = r.candidate.topology, r.candidate.knobs
    return {
        "label": r.candidate.label,
        "topology": {"colocated": t.colocated, "prefill": t.prefill, "decode": t.decode,
                     "replicas": t.replicas, "cpus_per_engine": t.cpus_per_engine},
        "knobs": {f: getattr(k, f) for f in KNOB_FIELDS},
        "goodput": r.score(slo),
        "best": None if b is None else vars(b),
        "points": [vars(p) for p in r.points],
        "error": r.error,
        "complete": r.complete,
        "wall_s": r.wall_s,
    }
