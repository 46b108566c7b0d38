"""Sampler: processors, distributions (chi-square), seeded reproducibility, logprobs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from tandem.engine.categorical import (
    SAMPLER_STREAM,
    key_generator,
    row_keys,
    sample_race_logits,
)
from tandem.engine.request import Request
from tandem.engine.sampler import Sampler, is_temperature_only
from tandem.engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    params: SamplingParams,
    prompt: list[int] | None = None,
    outputs: list[int] | None = None,
    eos: int | None = None,
) -> Request:
    req = Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt or [0]),
        sampling_params=params,
        eos_token_id=eos,
    )
    for t in outputs or []:
        req.append_output_token(t)
    return req


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def draw(params: SamplingParams, logits: torch.Tensor, num: int, seed: int = 0) -> torch.Tensor:
    """``num`` samples of one distribution through batches of 500 unseeded rows."""
    sampler = Sampler(seed=seed)
    counts = torch.zeros(logits.numel())
    batch = 500
    for _ in range(num // batch):
        reqs = [make_request(params) for _ in range(batch)]
        out = sampler(logits.repeat(batch, 1), reqs)
        for tok, _ in out:
            counts[tok] += 1
    return counts


def check_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    exp = expected[support] / expected[support].sum() * counts.sum()
    _, pvalue = chisquare(counts[support].numpy(), exp.numpy())
    assert pvalue > 1e-3, f"counts {counts.tolist()} vs expected {exp.tolist()} (p={pvalue})"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    counts = draw(SamplingParams(temperature=temperature), LOGITS, 10_000)
    check_distribution(counts, torch.softmax(LOGITS / temperature, dim=0))


def test_top_k_distribution() -> None:
    counts = draw(SamplingParams(temperature=1.0, top_k=3), LOGITS, 10_000)
    expected = torch.softmax(LOGITS, dim=0)
    expected[3:] = 0
    check_distribution(counts, expected)


def test_top_p_distribution() -> None:
    probs = torch.softmax(LOGITS, dim=0)
    # cumulative: 0.39, 0.62, 0.77, 0.86, ... -> top_p=0.7 keeps three tokens.
    counts = draw(SamplingParams(temperature=1.0, top_p=0.7), LOGITS, 10_000)
    expected = probs.clone()
    expected[3:] = 0
    check_distribution(counts, expected)


def test_top_k_and_top_p_and_min_p_compose() -> None:
    probs = torch.softmax(LOGITS, dim=0)
    # top_k=4 renormalises to 4 tokens; top_p=0.85 then drops the 4th (0.90 before it).
    counts = draw(SamplingParams(temperature=1.0, top_k=4, top_p=0.85), LOGITS, 6_000)
    expected = probs.clone()
    expected[3:] = 0
    check_distribution(counts, expected)
    # min_p=0.5: keep tokens with p >= 0.5 * p_max -> 2.0, 1.5 (exp(-0.5)=0.61), not 1.0 (0.37).
    counts = draw(SamplingParams(temperature=1.0, min_p=0.5), LOGITS, 6_000)
    expected = probs.clone()
    expected[2:] = 0
    check_distribution(counts, expected)


def test_greedy_is_argmax_and_ignores_generators() -> None:
    logits = torch.randn(8, 100)
    reqs = [make_request(SamplingParams(temperature=0.0, seed=i)) for i in range(8)]
    states = [r.generator.get_state().clone() for r in reqs]
    out = Sampler()(logits.clone(), reqs)
    assert [t for t, _ in out] == logits.argmax(dim=-1).tolist()
    for r, s in zip(reqs, states, strict=True):
        assert torch.equal(r.generator.get_state(), s), "greedy must not consume the generator"


def test_greedy_ties_take_the_first_index_like_argmax() -> None:
    """Exact ties (bf16 logits widened to float32 tie often) resolve to the
    lowest token id, as transformers' argmax does; a vocabulary-sized row too."""
    logits = torch.zeros(3, 49152)
    logits[0, [7, 3, 40000]] = 5.0
    logits[1, [49151, 12]] = 1.0
    reqs = [make_request(SamplingParams(temperature=0.0)) for _ in range(3)]
    out = Sampler()(logits.clone(), reqs)
    assert [t for t, _ in out] == [3, 12, 0]
    assert [t for t, _ in out] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ],
    ids=["plain", "logprobs", "logit_bias", "penalty"],
)
def test_bf16_logits_give_the_float32_result(params: SamplingParams) -> None:
    """The runner hands the sampler the model's bf16 logits: plain greedy rows take
    their argmax as is, every other row is widened to float32 first; both must
    give exactly what the float32 logits give (ties included)."""
    torch.manual_seed(0)
    logits = (torch.randn(6, 300) * 3).bfloat16()
    logits[0, [9, 4]] = 20.0  # an exact tie: the lower id wins
    reqs = [make_request(params, prompt=[5, 7]) for _ in range(6)]
    got = Sampler()(logits.clone(), reqs)
    want = Sampler()(logits.float(), reqs)
    assert got == want
    if params.logit_bias is None and params.repetition_penalty == 1.0:
        assert got[0][0] == 4


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(4, 50)
    reqs = [
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=1.0)),
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=0.8, top_k=5)),
    ]
    out = Sampler()(logits.clone(), reqs)
    assert out[0][0] == int(logits[0].argmax())
    assert out[2][0] == int(logits[2].argmax())
    assert out[3][0] in logits[3].topk(5).indices.tolist()


def test_seeded_sampling_independent_of_batch_composition() -> None:
    torch.manual_seed(0)
    vocab = 300
    steps = [torch.randn(vocab) for _ in range(12)]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(batch_extra: int, sampler_seed: int) -> list[int]:
        target = make_request(params)
        others = [
            make_request(SamplingParams(temperature=1.0 + 0.1 * j, seed=None if j % 2 else j))
            for j in range(batch_extra)
        ]
        sampler = Sampler(seed=sampler_seed)
        tokens = []
        for step_logits in steps:
            batch = others[: batch_extra // 2] + [target] + others[batch_extra // 2 :]
            logits = torch.randn(len(batch), vocab)
            logits[batch_extra // 2] = step_logits
            out = sampler(logits, batch)
            tok = out[batch_extra // 2][0]
            target.append_output_token(tok)
            tokens.append(tok)
        return tokens

    alone = run(0, sampler_seed=0)
    assert run(7, sampler_seed=1) == alone
    assert run(15, sampler_seed=2) == alone
    # A different seed gives a different sequence (12 draws from a 300-token vocabulary).
    other = make_request(SamplingParams(temperature=1.0, top_p=0.9, seed=4321))
    sampler = Sampler()
    diff = [sampler(s.unsqueeze(0).clone(), [other])[0][0] for s in steps]
    assert diff != alone


def test_temperature_only_rows_are_those_without_truncation_or_logprobs() -> None:
    """The rows the fused race (no softmax) draws: one rule, per row."""
    assert is_temperature_only(SamplingParams(temperature=0.7))
    assert is_temperature_only(SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=3))
    assert not is_temperature_only(SamplingParams(temperature=0.0))
    assert not is_temperature_only(SamplingParams(temperature=1.0, top_k=5))
    assert not is_temperature_only(SamplingParams(temperature=1.0, top_p=0.9))
    assert not is_temperature_only(SamplingParams(temperature=1.0, min_p=0.1))
    assert not is_temperature_only(SamplingParams(temperature=1.0, logprobs=0))
    assert not is_temperature_only(SamplingParams(temperature=math.inf))


def test_temperature_only_rows_draw_what_the_softmax_path_draws() -> None:
    """The fused race (temperature only) against the softmax path on the same keys: a
    top_k as large as the vocabulary truncates nothing but takes the softmax path. The
    same seeds give the same tokens on 200 rows of 4,000 (masked tokens via min_tokens
    included): dropping the softmax's normaliser moves no draw but at a float near-tie,
    which these rows do not have."""
    vocab = 4000
    logits = torch.randn(200, vocab, generator=torch.Generator().manual_seed(3)) * 3
    temps = [0.3 + 0.01 * i for i in range(200)]

    def tokens(**extra: int) -> list[int]:
        reqs = [make_request(SamplingParams(temperature=t, seed=i, min_tokens=2 * (i % 2),
                                            stop_token_ids=list(range(0, vocab, 3)), **extra),
                             eos=1)
                for i, t in enumerate(temps)]
        return [tok for tok, _ in Sampler()(logits.clone(), reqs)]

    fused = tokens()
    assert fused == tokens(top_k=vocab)
    assert not any(t % 3 == 0 or t == 1 for t in fused[1::2])  # masked by min_tokens


def test_temperature_only_rows_read_bf16_logits_as_their_float32_widening() -> None:
    """Without processors the fused race reads the model's bf16 logits (no float32 copy)
    and draws exactly what the widened float32 logits draw, greedy rows beside it."""
    logits = (torch.randn(64, 3000, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    reqs = [make_request(SamplingParams(temperature=0.0 if i % 5 == 0 else 0.5 + 0.02 * i,
                                        seed=i))
            for i in range(64)]
    before = logits.clone()
    got = Sampler()(logits, reqs)
    assert torch.equal(logits, before)
    assert got == Sampler()(logits.float(), reqs)


def test_float16_logits_give_the_float32_result() -> None:
    """A float16 model's logits (``LLM(dtype="float16")``) on every path, greedy, fused
    temperature-only, truncated and logprobs rows in one batch: each row draws what the
    float32 widening of its logits draws (the widening is exact)."""
    logits = (torch.randn(8, 500, generator=torch.Generator().manual_seed(5)) * 3).half()
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
             SamplingParams(temperature=0.7, top_p=0.9, seed=2),
             SamplingParams(temperature=0.9, top_k=20, min_p=0.05, seed=3),
             SamplingParams(temperature=0.6, logprobs=2, seed=4),
             SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=5)]
    for rows in ([kinds[1]] * 8, [kinds[i % len(kinds)] for i in range(8)]):
        reqs = [make_request(p, prompt=[5, 7]) for p in rows]
        got = Sampler()(logits.clone(), reqs)
        assert got == Sampler()(logits.float(), reqs)


def test_a_row_draws_the_same_whichever_paths_the_other_rows_take() -> None:
    """Greedy, fused (temperature only), truncated and logprobs rows in one batch: each
    seeded row gets the token (and logprobs) it gets alone, and the unseeded rows' keys
    are handed out in row order as before (greedy rows take one too)."""
    vocab = 500
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(5)) * 2
    params = [
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.2, top_p=0.8, seed=12),
        SamplingParams(temperature=0.9, seed=13, presence_penalty=0.5),
        SamplingParams(temperature=0.7, logprobs=3, seed=14),
        SamplingParams(temperature=1.0, top_k=50, min_p=0.05, seed=15),
    ]
    reqs = [make_request(p, outputs=[2, 3]) for p in params]
    batch = Sampler()(logits.clone(), reqs)
    alone = [Sampler()(logits[i : i + 1].clone(), [r])[0] for i, r in enumerate(reqs)]
    assert batch == alone
    # the processed logprobs of a random row: log_softmax(logits / T), before truncation
    expected = torch.log_softmax(logits[4] / 0.7, dim=0)
    lps = batch[4][1]
    assert lps is not None and len(lps) >= 3
    for t, lp in lps.items():
        assert math.isclose(lp.logprob, float(expected[t]), rel_tol=1e-5)
    # unseeded: the sampler's key stream in row order, whichever path draws a row
    unseeded = [make_request(SamplingParams(temperature=0.0 if i == 0 else 1.0,
                                            top_k=7 if i == 2 else -1))
                for i in range(4)]
    got = [t for t, _ in Sampler(seed=9)(logits[:4].clone(), unseeded)]
    keys = row_keys([None] * 4, key_generator(9, SAMPLER_STREAM))
    rows = [1, 3]
    want = sample_race_logits(logits[rows], torch.ones(2), keys[rows]).tolist()
    assert [got[1], got[3]] == want


def test_logit_bias_forces_token() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    reqs = [
        make_request(SamplingParams(temperature=0.0, logit_bias={7: 10.0})),
        make_request(SamplingParams(temperature=1.0, logit_bias={3: -100.0, 8: 100.0})),
    ]
    out = Sampler()(logits, reqs)
    assert [t for t, _ in out] == [7, 8]


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2] = 10.0  # EOS
    logits[0, 5] = 9.0  # stop token
    logits[0, 6] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    before = make_request(p, outputs=[1], eos=2)
    assert Sampler()(logits.clone(), [before])[0][0] == 6
    reached = make_request(p, outputs=[1, 1], eos=2)
    assert Sampler()(logits.clone(), [reached])[0][0] == 2
    # ignore_eos: EOS is not a stop token, so it is not masked.
    p2 = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits.clone(), [make_request(p2, eos=2)])[0][0] == 2


def test_repetition_penalty_ctrl_rule() -> None:
    logits = torch.tensor([[4.0, 3.0, -1.0, -1.5, 0.5]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=4)
    # prompt holds token 0, output holds token 2: 4.0 -> 2.0, -1.0 -> -2.0
    req = make_request(p, prompt=[0], outputs=[2])
    tok, lps = Sampler()(logits.clone(), [req])[0]
    assert tok == 1
    expected = torch.log_softmax(torch.tensor([2.0, 3.0, -2.0, -1.5, 0.5]), dim=0)
    for t, lp in lps.items():
        assert math.isclose(lp.logprob, float(expected[t]), rel_tol=1e-5)


def test_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.6, presence_penalty=0.5, logprobs=3)
    # output: token 0 twice -> 3 - 1.2 - 0.5 = 1.3 ; token 1 once -> 2 - 0.6 - 0.5 = 0.9
    # prompt tokens are not penalised.
    req = make_request(p, prompt=[2, 2, 2], outputs=[0, 0, 1])
    tok, lps = Sampler()(logits.clone(), [req])[0]
    assert tok == 0
    expected = torch.log_softmax(torch.tensor([1.3, 0.9, 1.0, 0.0]), dim=0)
    for t, lp in lps.items():
        assert math.isclose(lp.logprob, float(expected[t]), rel_tol=1e-5)
    # A stronger frequency penalty flips the choice away from the repeated token.
    p2 = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert Sampler()(logits.clone(), [make_request(p2, outputs=[0, 0])])[0][0] == 1
    assert Sampler()(logits.clone(), [make_request(SamplingParams(temperature=0.0))])[0][0] == 0


def test_logprobs_top_n_and_rank() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 1.0]])
    p = SamplingParams(temperature=0.0, logprobs=2)
    tok, lps = Sampler()(logits.clone(), [make_request(p)])[0]
    expected = torch.log_softmax(logits[0], dim=0)
    assert tok == 1
    assert list(lps) == [1, 2]
    assert lps[1].rank == 1 and lps[2].rank == 2
    assert math.isclose(lps[2].logprob, float(expected[2]), rel_tol=1e-6)
    # A sampled token outside the top-N is included with its rank (forced by bias).
    p0 = SamplingParams(temperature=0.0, logprobs=1, logit_bias={3: 4.5})
    tok, lps = Sampler()(logits.clone(), [make_request(p0)])[0]
    assert tok == 3 and lps[3].rank == 1
    # Random sampling between two near-equal tokens: find a draw of the second one.
    close = torch.tensor([[0.1, 3.0, 2.999, -1.0, 1.0]])
    for seed in range(64):
        p1 = SamplingParams(temperature=1.0, logprobs=1, top_k=2, seed=seed)
        tok, lps = Sampler()(close.clone(), [make_request(p1)])[0]
        if tok == 2:
            break
    assert tok == 2
    assert list(lps) == [2, 1] and lps[2].rank == 2 and lps[1].rank == 1
    p2 = SamplingParams(temperature=1.0, logprobs=0, top_k=2, seed=seed)
    tok, lps = Sampler()(close.clone(), [make_request(p2)])[0]
    assert tok == 2 and list(lps) == [2]


def test_no_logprobs_when_not_requested() -> None:
    out = Sampler()(torch.randn(2, 9), [make_request(SamplingParams()) for _ in range(2)])
    assert all(lp is None for _, lp in out)
