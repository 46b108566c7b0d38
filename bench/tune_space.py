"""The configurations `tandem tune` searches: how a host's CPUs split into engines
(``Topology``), the scheduler knobs and their ladders (``Knobs``, ``Space``), one point of
that space (``Candidate``) and the default the search starts from. ``tune_search.py``
searches it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.engine.config import SchedulerConfig

_DEFAULT_SCHED = SchedulerConfig()


# ---- what is searched ---------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """How the engines split the resources: colocated replicas or a prefill:decode split.

    Attributes:
        colocated: engines in the colocated role (``replicas`` of them) instead of
            ``prefill`` prefill and ``decode`` decode engines.
        cpus_per_engine: CPUs pinned to each engine (``tandem up --cpus-per-engine``);
            0: not pinned (every engine may run on every CPU).
    """

    colocated: bool
    prefill: int = 0
    decode: int = 0
    replicas: int = 0
    cpus_per_engine: int = 0

    def __post_init__(self) -> None:
        if self.colocated and self.replicas < 1:
            raise ValueError(f"a colocated topology needs replicas >= 1, got {self.replicas}")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a disaggregated topology needs prefill >= 1 and decode >= 1, "
                             f"got {self.prefill}:{self.decode}")

    @property
    def num_engines(self) -> int:
        return self.replicas if self.colocated else self.prefill + self.decode

    @property
    def label(self) -> str:
        what = f"colocated x{self.replicas}" if self.colocated else f"{self.prefill}P:{self.decode}D"
        pin = f"{self.cpus_per_engine} cpu" if self.cpus_per_engine else "unpinned"
        return f"{what} ({pin})"


@dataclass(frozen=True)
class Knobs:
    """The engine's scheduler settings searched (vLLM's names); every engine gets the same.

    Attributes:
        max_num_batched_tokens: token budget of one engine step.
        max_num_seqs: most requests running at once.
        long_prefill_token_threshold: the chunked-prefill size: most prompt tokens one
            request takes per step (0: no cap, a prompt may fill the step budget).
    """

    max_num_batched_tokens: int = _DEFAULT_SCHED.max_num_batched_tokens
    max_num_seqs: int = _DEFAULT_SCHED.max_num_seqs
    long_prefill_token_threshold: int = _DEFAULT_SCHED.long_prefill_token_threshold

    def normalized(self) -> Knobs:
        """The same behaviour with a chunk size at or above the step budget written as 0
        (no cap): both let a prompt fill the step, so they are one candidate."""
        if self.long_prefill_token_threshold >= self.max_num_batched_tokens:
            return replace(self, long_prefill_token_threshold=0)
        return self

    def engine_args(self) -> list[str]:
        """The engine flags (``tandem serve``) that set these knobs."""
        return [f"--max-num-batched-tokens={self.max_num_batched_tokens}",
                f"--max-num-seqs={self.max_num_seqs}",
                f"--long-prefill-token-threshold={self.long_prefill_token_threshold}"]

    @property
    def label(self) -> str:
        chunk = self.long_prefill_token_threshold or "-"
        return f"mnbt={self.max_num_batched_tokens} mns={self.max_num_seqs} chunk={chunk}"


#: The knobs searched, in the order the fine search steps them.
KNOB_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold")


@dataclass(frozen=True)
class Candidate:
    """One configuration: a split of the resources and the engines' knobs."""

    topology: Topology
    knobs: Knobs = Knobs()

    @property
    def label(self) -> str:
        return f"{self.topology.label} {self.knobs.label}"


@dataclass(frozen=True)
class Space:
    """What the search may try.

    Attributes:
        default: the baseline (what ``tandem up`` runs without flags); always measured.
        topologies: the splits of the resources, each tried at the default candidate's knobs.
        batched_tokens / num_seqs / chunk_sizes: the ladders the fine search steps
            along (values of ``max_num_batched_tokens``, ``max_num_seqs`` and
            ``long_prefill_token_threshold``), ascending; 0 (no chunk cap) goes last.
    """

    default: Candidate
    topologies: tuple[Topology, ...]
    batched_tokens: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    num_seqs: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    chunk_sizes: tuple[int, ...] = (64, 128, 256, 512, 1024, 0)

    def ladder(self, knob: str) -> tuple[int, ...]:
        """The ladder of one of ``KNOB_FIELDS``."""
        return {"max_num_batched_tokens": self.batched_tokens, "max_num_seqs": self.num_seqs,
                "long_prefill_token_threshold": self.chunk_sizes}[knob]

    def neighbours(self, c: Candidate, step: int) -> list[Candidate]:
        """Candidates ``step`` rungs up and down each knob's ladder from ``c`` (a value
        not on a ladder starts from the nearest rung; no chunk cap from the rung of the
        step budget), normalized, without ``c``."""
        out: list[Candidate] = []
        for name in KNOB_FIELDS:
            ladder = self.ladder(name)
            value = getattr(c.knobs, name)
            if name == "long_prefill_token_threshold" and value == 0:
                # no cap acts as a cap at the step budget: step down from there
                i = _rung(ladder, c.knobs.max_num_batched_tokens, no_cap_last=True)
            else:
                i = _rung(ladder, value, no_cap_last=name == "long_prefill_token_threshold")
            for j in (i + step, i - step):
                if 0 <= j < len(ladder) and ladder[j] != value:
                    n = Candidate(c.topology, replace(c.knobs, **{name: ladder[j]}).normalized())
                    if n != c and n not in out:
                        out.append(n)
        return out


def _rung(ladder: tuple[int, ...], value: int, no_cap_last: bool) -> int:
    """Index of ``value`` on ``ladder``, or of its nearest rung (log scale)."""
    if value in ladder:
        return ladder.index(value)
    if no_cap_last and value == 0:
        return len(ladder) - 1
    sized = [(i, v) for i, v in enumerate(ladder) if v > 0]
    return min(sized, key=lambda iv: abs(math.log(iv[1]) - math.log(max(value, 1))))[0]


def cpu_topologies(cpus: int) -> tuple[Topology, ...]:
    """The splits of ``cpus`` CPUs, each engine pinned to its own equal share.

    Colocated: 1, 2, 4 ... replicas of ``cpus // replicas`` CPUs. Disaggregated: 2, 4,
    8 ... engines of ``cpus // engines`` CPUs, with a quarter, half or three quarters of
    them prefilling (at least one of each role).

    Raises:
        ValueError: ``cpus`` < 1.
    """
    if cpus < 1:
        raise ValueError(f"--cpus must be >= 1, got {cpus}")
    out: list[Topology] = []
    n = 1
    while n <= cpus:
        out.append(Topology(colocated=True, replicas=n, cpus_per_engine=cpus // n))
        n *= 2
    n = 2
    while n <= cpus:
        for p in sorted({max(1, n // 4), n // 2, n - max(1, n // 4)}):
            out.append(Topology(colocated=False, prefill=p, decode=n - p,
                                cpus_per_engine=cpus // n))
        n *= 2
    return tuple(out)


def default_candidate() -> Candidate:
    """What ``tandem up`` starts without flags: 1 prefill + 1 decode engine, not pinned,
    the engine's default knobs but the step budget ``tandem up`` gives engines that take
    turns on shared cores (``TURNS_MAX_NUM_BATCHED_TOKENS``)."""
    from tandem.up import TURNS_MAX_NUM_BATCHED_TOKENS

    return Candidate(Topology(colocated=False, prefill=1, decode=1),
                     Knobs(max_num_batched_tokens=TURNS_MAX_NUM_BATCHED_TOKENS))


# ---- the SLO and a measurement ------------------------------------------------------------
