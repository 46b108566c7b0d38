"""Speculative decoding's pure parts: the config's validation, the n-gram proposer, the
rejection sampler's exactness (chi-square against the target distribution), the
back-off rule and the metrics that follow the engine's counters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.contracts.role import Role
from tandem.engine.categorical import row_keys
from tandem.engine.config import BACKOFF_PAUSE_STEPS, SpeculativeConfig
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import SchedulerStats
from tandem.engine.spec_decode.ngram import ngram_propose
from tandem.engine.spec_decode.policy import SpecDecodePolicy, SpecDecodeStats
from tandem.engine.spec_decode.rejection_sampler import greedy_accept, rejection_sample
from tandem.services.common.metrics import ServiceMetrics

# -- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "model": "/x"}, "model"),
        ({"method": "draft_model"}, "model"),
        ({"method": "draft_model", "model": "/x", "prompt_lookup_max": 3}, "prompt_lookup"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"num_lookahead": 3}, "num_lookahead"),
        ([1, 2], "speculative_config"),
    ],
)
def test_config_errors_name_the_field(value, field) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(value)


def test_config_defaults_and_json() -> None:
    cfg = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig(prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(prompt_lookup_min=3).prompt_lookup_max == 3
    with pytest.raises(ValueError, match="speculative_config is not valid JSON"):
        SpeculativeConfig.from_json("{method: ngram}")


# -- n-gram proposer ---------------------------------------------------------------------


def test_ngram_longest_suffix_and_latest_full_occurrence() -> None:
    # Suffix [1, 2, 3] occurs at 0 (followed by 9 9) and 5 (followed by 7 8 ...).
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 6, 4, 2, 3]
    # Longest suffix in 1..3 found earlier: [2, 3] (at 1, 6); the latest with 2 after.
    assert ngram_propose(tokens, 1, 3, 2) == [7, 8]
    # Only 1-grams: [3] latest with 2 tokens after it is at 7.
    assert ngram_propose(tokens, 1, 1, 2) == [7, 8]
    # No earlier occurrence of any suffix of length >= 3.
    assert ngram_propose(tokens, 3, 3, 2) == []
    # k past the end: the earliest occurrence, which has the most tokens after it.
    assert ngram_propose([5, 5, 5, 5], 2, 2, 3) == [5, 5]
    assert ngram_propose([4], 1, 2, 3) == []


def _ngram_by_windows(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, spelled out: every suffix length, longest first, over all windows."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        ends = [i + n for i in range(num - n) if tokens[i : i + n] == tokens[num - n :]]
        if ends:
            full = [e for e in ends if e + k <= num]
            end = full[-1] if full else ends[0]
            return tokens[end : end + k]
    return []


def test_ngram_matches_the_window_definition() -> None:
    """The lookup extends the shortest suffix's matches backwards; on random sequences
    over small vocabularies (many matches of every length) it proposes what the window
    by window definition does."""
    g = torch.Generator().manual_seed(2)
    for trial in range(400):
        vocab = 2 + trial % 6
        tokens = torch.randint(0, vocab, (1 + trial % 40,), generator=g).tolist()
        for min_n, max_n, k in ((1, 1, 3), (2, 5, 3), (1, 4, 1), (3, 3, 5)):
            assert ngram_propose(tokens, min_n, max_n, k) == _ngram_by_windows(
                tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


# -- rejection sampler -------------------------------------------------------------------


def test_greedy_accept() -> None:
    assert greedy_accept([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert greedy_accept([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert greedy_accept([1], [2, 9]) == [2]


def _probs_from(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target's distribution under ``params``, through the sampler's own code."""
    req = Request("r", [0], params)
    processed = Sampler.process_logits(logits.clone().unsqueeze(0), [req])
    return Sampler.target_probs(processed, [req])[0]


NUM_DRAWS = 120_000
VOCAB = 8


def _chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("point_mass", [True, False], ids=["point-mass-q", "draft-q"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["plain", "top-k", "top-p"],
)
def test_rejection_sampler_keeps_the_target_distribution(point_mass, params) -> None:
    """Each emitted position is distributed as the target's p (chi-square, p > 0.01),
    with a draft distribution q far from p (it favours what p makes unlikely)."""
    g = torch.Generator().manual_seed(1)
    k = 2
    logits = [torch.randn(VOCAB, generator=g) * 1.5 for _ in range(k + 1)]
    p = torch.stack([_probs_from(lg, params) for lg in logits])  # [k + 1, V]
    q = torch.softmax(-torch.stack(logits[:k]), dim=-1)  # far from p
    drafts = torch.stack([torch.multinomial(q[j], NUM_DRAWS, replacement=True, generator=g)
                          for j in range(k)], dim=1)  # [N, k]
    if point_mass:
        # A deterministic proposer: each row's q is the point mass on its draft.
        draft_probs = None
    else:
        draft_probs = q.unsqueeze(0).expand(NUM_DRAWS, k, VOCAB)
    target = p.unsqueeze(0).expand(NUM_DRAWS, k + 1, VOCAB)
    keys = row_keys([None] * NUM_DRAWS, np.random.Generator(np.random.PCG64(5)))
    out = rejection_sample(drafts, [k] * NUM_DRAWS, target, draft_probs,
                           [None] * NUM_DRAWS, torch.Generator().manual_seed(5), keys)
    first = torch.tensor([o[0] for o in out])
    assert _chi_square_p(first, p[0]) > 0.01
    # Position 1 where position 0's draft was accepted: an independent step under p[1].
    second = torch.tensor([o[1] for o in out if len(o) > 1])
    assert len(second) > 1000
    assert _chi_square_p(second, p[1]) > 0.01
    lengths = torch.tensor([len(o) for o in out])
    assert int(lengths.min()) >= 1 and int(lengths.max()) == k + 1


def test_rejection_sampler_can_tell_a_wrong_distribution() -> None:
    """The test above can fail: accepting every draft (ignoring p) is caught."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(VOCAB, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(VOCAB, generator=g) * 1.5, dim=-1)
    drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=g)
    assert _chi_square_p(drafts, p) < 0.01


def test_rejection_sampler_seeded_rows_are_reproducible() -> None:
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(4, 3, VOCAB, generator=g), dim=-1)
    drafts = torch.randint(0, VOCAB, (4, 2), generator=g)

    def run(shared_seed: int) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(10 + i) if i % 2 == 0 else None for i in range(4)]
        keys = row_keys([10 + i if i % 2 == 0 else None for i in range(4)],
                        np.random.Generator(np.random.PCG64(shared_seed)))
        return rejection_sample(drafts, [2, 1, 2, 2], p, None, gens,
                                torch.Generator().manual_seed(shared_seed), keys)

    a, b = run(0), run(99)
    # Seeded rows (0 and 2) do not depend on the shared generator.
    assert a[0] == b[0] and a[2] == b[2]
    assert run(0) == a
    assert len(a[1]) <= 2  # one draft: at most that and a bonus


# -- back-off rule -----------------------------------------------------------------------


def test_backoff_halves_pauses_and_recovers() -> None:
    policy = SpecDecodePolicy(SpeculativeConfig(num_speculative_tokens=4), max_seq_len=1000)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=500))
    assert policy.num_lookahead(req, num_running=1, num_computed_after=3) == 4
    policy.on_verified(req, 4, 0)
    assert req.num_spec_tokens == 2
    policy.on_verified(req, 2, 0)
    policy.on_verified(req, 1, 0)
    assert req.num_spec_tokens == 0 and req.spec_pause_steps == BACKOFF_PAUSE_STEPS
    for _ in range(BACKOFF_PAUSE_STEPS):
        assert policy.num_lookahead(req, 1, 3) == 0
    assert policy.num_lookahead(req, 1, 3) == 1
    policy.on_verified(req, 1, 1)
    assert policy.num_lookahead(req, 1, 3) == 2
    assert policy.stats.num_drafts == 4 and policy.stats.num_accepted_tokens_per_pos[0] == 1


def test_lookahead_respects_max_tokens_and_batch_size() -> None:
    cfg = SpeculativeConfig(num_speculative_tokens=5, disable_by_batch_size=2)
    policy = SpecDecodePolicy(cfg, max_seq_len=1000)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    # After a prefill step (3 computed) the request holds 4 tokens (1 output): 3 left,
    # so the next verification may propose 2 (it emits up to 3).
    assert policy.num_lookahead(req, 1, 3) == 2
    assert policy.num_lookahead(req, 3, 3) == 0  # more running than disable_by_batch_size


def _idle_stats(spec: SpecDecodeStats) -> SchedulerStats:
    """The real stats type of an idle engine with ``spec`` (a hand-made stand-in drifted
    from it once the store tier added fields)."""
    return SchedulerStats(num_running=0, num_waiting=0, num_waiting_for_remote_kv=0,
                          kv_cache_usage=0.0, num_free_blocks=8, num_total_blocks=8,
                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                          num_kv_load_failures=0, num_pending_kv_sends=0, spec_decode=spec)


def test_metrics_follow_spec_decode_stats() -> None:
    m = ServiceMetrics(Role.DECODE)

    stats = _idle_stats(SpecDecodeStats(2, num_drafts=3, num_draft_tokens=5,
                                        num_accepted_tokens=4, num_accepted_tokens_per_pos=[3, 1]))
    m.observe_stats(stats, 0)
    m.observe_stats(stats, 0)  # counters follow totals: no double count
    value = m.registry.get_sample_value
    assert value("tandem:spec_decode_num_drafts_total", {"role": "decode"}) == 3
    assert value("tandem:spec_decode_num_draft_tokens_total", {"role": "decode"}) == 5
    assert value("tandem:spec_decode_num_accepted_tokens_total", {"role": "decode"}) == 4
    assert value("tandem:spec_decode_num_accepted_tokens_per_pos_total",
                 {"role": "decode", "position": "1"}) == 1


# -- flags -------------------------------------------------------------------------------


def test_speculative_config_flag_of_serve_and_up() -> None:
    from tandem.services.common.server import build_engine_config, build_parser
    from tandem.up import Stack, config_from_args
    from tandem.up import build_parser as up_parser

    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    ns = build_parser("tandem serve", None).parse_args(
        ["--role", "both", "--speculative-config", spec])
    cfg = build_engine_config(ns, "both")
    assert cfg.speculative == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=3,
                                                prompt_lookup_max=3)
    assert build_engine_config(build_parser("x", None).parse_args(["--role", "both"]),
                               "both").speculative is None
    bad = build_parser("x", None).parse_args(
        ["--role", "both", "--speculative-config", '{"num_speculative_tokens": 20}'])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_engine_config(bad, "both")
    stack_cfg = config_from_args(up_parser().parse_args(["--speculative-config", spec]))
    assert Stack(stack_cfg)._spec_args() == ["--speculative-config", spec]
    with pytest.raises(ValueError, match="method"):
        config_from_args(up_parser().parse_args(["--speculative-config", '{"method": "x"}']))


def test_latency_bench_reads_acceptance_from_metrics() -> None:
    from prometheus_client import generate_latest

    from tandem.bench.latency import make_prompt, spec_decode_counters

    m = ServiceMetrics(Role.BOTH)

    m.observe_stats(_idle_stats(SpecDecodeStats(2, num_drafts=4, num_draft_tokens=8,
                                                num_accepted_tokens=6,
                                                num_accepted_tokens_per_pos=[4, 2])), 0)
    c = spec_decode_counters(generate_latest(m.registry).decode())
    assert c["spec_decode_num_draft_tokens"] == 8 and c["spec_decode_num_accepted_tokens"] == 6
    assert c["acceptance_rate"] == 0.75 and c["mean_acceptance_length"] == 2.5
    import random

    p = make_prompt(random.Random(0), 10, 100, "repeated")
    assert len(p) == 10 and p[:3] == p[3:6]


def test_serve_bench_runs_each_stack_without_and_with_speculation(capsys, tmp_path) -> None:
    from tandem.bench.serve import launch_plan, main, side_by_side
    from tandem.up import Stack, StackConfig

    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert launch_plan(["disagg", "colocated"], spec) == [
        ("disagg", None, "disagg"), ("disagg", spec, "disagg+spec"),
        ("colocated", None, "colocated"), ("colocated", spec, "colocated+spec")]
    assert launch_plan(["disagg"], None) == [("disagg", None, "disagg")]
    assert main(["--speculative-config", spec]) == 2  # no stack of its own to compare
    assert "--speculative-config: needs --launch" in capsys.readouterr().err
    assert main(["--launch", "disagg", "--speculative-config", '{"method": "x"}']) == 2
    assert "--speculative-config: method" in capsys.readouterr().err
    # Every engine gets a /metrics port (the spec_decode counters are the decode's).
    stack = Stack(StackConfig(speculative_config=spec, engine_metrics=True))
    stack.tmpdir = tmp_path  # what start() makes
    decode = stack._engine_part("decode-0", ["decode"])
    prefill = stack._engine_part("prefill-0", ["prefill"])
    assert "--metrics-port" in decode.argv and "--metrics-port" in prefill.argv
    assert list(stack.engine_metrics_urls) == ["decode-0", "prefill-0"]
    plain = Stack(StackConfig())
    plain.tmpdir = tmp_path
    assert "--metrics-port" not in plain._engine_part("d", ["decode"]).argv
    base = {"label": "disagg", "request_rate": 1.0, "output_throughput": 10.0,
            "median_ttft_ms": 5.0, "median_tpot_ms": 2.0, "median_itl_ms": 2.0}
    counters = {"spec_decode_num_drafts": 4.0, "spec_decode_num_draft_tokens": 8.0,
                "spec_decode_num_accepted_tokens": 6.0}
    table = side_by_side([base, {**base, "label": "disagg+spec",
                                 "speculative": {"decode-0": counters}}])
    assert table.splitlines()[2].endswith("|  |  |")
    assert table.splitlines()[3].endswith("| 0.750 | 2.50 |")


def test_verify_samples_each_position_under_its_own_rules() -> None:
    """Through ``verify``: position 0 follows p after the request's own tokens, position
    1 (after an accepted draft) p with that draft counted as output, here by a
    repetition penalty and ``min_tokens`` (EOS banned only at position 0)."""
    from tandem.engine.spec_decode.verify import verify

    num = 6_000
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]  # likely accepted
    eos = int(logits[1].topk(2).indices[1])
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0, min_tokens=1,
                            max_tokens=10)
    reqs = [Request(f"r{i}", [0, 1], params, eos_token_id=eos) for i in range(num)]
    sampler = Sampler(seed=0)
    out = verify(sampler, logits.repeat(num, 1), reqs, [drafts] * num)

    def p_after(extra: list[int], row: int) -> torch.Tensor:
        r = Request("x", [0, 1], params, eos_token_id=eos)
        for t in extra:
            r.append_output_token(t)
        return Sampler.target_probs(Sampler.process_logits(logits[row : row + 1].clone(), [r]),
                                    [r])[0]

    first = torch.tensor([toks[0] for toks, _ in out])
    assert _chi_square_p(first, p_after([], 0)) > 0.01
    second = torch.tensor([toks[1] for toks, _ in out if len(toks) > 1 and toks[0] == drafts[0]])
    assert len(second) > 500
    p1 = p_after([drafts[0]], 1)
    assert p1[eos] > 0  # min_tokens no longer bans EOS at position 1
    assert _chi_square_p(second, p1) > 0.01
    # Without the draft counted as output, EOS would be banned there: it was emitted.
    assert p_after([], 1)[eos] == 0 and int((second == eos).sum()) > 0


def test_verify_with_draft_probs_mixed_with_point_masses() -> None:
    """``verify`` given a draft model's ``q`` for some requests and none (point masses)
    for others in one batch: both groups emit p; drafts drawn from q = p are all
    accepted, point masses on them only at rate p(d)."""
    from tandem.engine.spec_decode.verify import verify

    num = 6_000
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, VOCAB, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, max_tokens=10)
    reqs = [Request(f"r{i}", [0, 1], params) for i in range(num)]
    p = _probs_from(logits[0], params)
    far = torch.softmax(-logits[0], dim=-1)
    # Even rows: drafts drawn from q (p itself for the first half, far from p after);
    # odd rows: the same kind of draws verified as point masses.
    qs = [(p if i < num // 2 else far) for i in range(num)]
    drafts = [[int(torch.multinomial(q, 1, generator=g))] for q in qs]
    draft_probs = [q.unsqueeze(0) if i % 2 == 0 else None for i, q in enumerate(qs)]
    out = verify(Sampler(seed=0), logits.repeat(num, 1), reqs, drafts, None, draft_probs)
    first = torch.tensor([toks[0] for toks, _ in out])
    for rows in (slice(0, None, 2), slice(1, None, 2), slice(num // 2, None)):
        assert _chi_square_p(first[rows], p) > 0.01
    accepted = torch.tensor([len(toks) == 2 for toks, _ in out], dtype=torch.float64)
    assert float(accepted[0 : num // 2 : 2].mean()) == 1.0  # q = p: min(1, p / q) = 1
    assert float(accepted[1 : num // 2 : 2].mean()) < 0.9
