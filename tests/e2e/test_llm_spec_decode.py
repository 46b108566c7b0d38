"""Speculative decoding end to end on a tiny random-weight model, float32.

Oracle: the same engine without speculation (itself held to transformers' greedy
``generate`` in test_llm_tiny_models.py), token for token, in mixed batches with
prefix caching, chunked prefill and forced preemption; block accounting exact after.
Each test also checks that drafts were both accepted and rejected, so both paths of
the verification ran.
"""

from __future__ import annotations

import pytest
import torch
from engine_steps import run
from tiny_models import tiny_config, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.request import Request

VOCAB = 64
MAX_LEN = 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("spec-tiny"))
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=128, max_len=MAX_LEN,
                         special_tokens=False)
    # A small std: the model falls into loops that prompt lookup can predict.
    tiny_hf_model(config, std=0.1, seed=3).save_pretrained(path)
    return path


def prompts(num: int = 16) -> list[list[int]]:
    """Half repeat a pattern (prompt lookup pays), half are random."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(num):
        if i % 2 == 0:
            pattern = torch.randint(0, VOCAB, (3 + i % 5,), generator=g).tolist()
            out.append(pattern * (2 + i % 3) + [i])
        else:
            out.append(torch.randint(0, VOCAB, (5 + 3 * i,), generator=g).tolist())
    return out


def make_llm(folder: str, spec: dict | None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 4 << 20)
    return LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, block_size=4,
               speculative_config=spec, **kwargs)


def token_ids(llm: LLM, ps, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(ps, params, use_tqdm=False)]


def assert_clean(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.has_unfinished_requests()


def assert_both_paths(llm: LLM) -> None:
    st = llm.llm_engine.engine_core.get_stats().spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st


GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_greedy_without_speculation(folder, k) -> None:
    """A batch of 16 with chunked prefill (a 48-token budget that also truncates
    drafts) and prefix caching, run twice so the second run reuses cached blocks
    written by verified steps."""
    ps = prompts()
    base = make_llm(folder, None, max_num_batched_tokens=48)
    want = token_ids(base, ps, GREEDY)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    llm = make_llm(folder, spec, max_num_batched_tokens=48)
    assert token_ids(llm, ps, GREEDY) == want
    assert_both_paths(llm)
    assert_clean(llm)
    hits_before = llm.llm_engine.engine_core.get_stats().prefix_cache_hits
    # Prompts extended by their outputs: the cached blocks hold verified tokens' KV.
    longer = [p + w[0][:20] for p, w in zip(ps, want, strict=True)]
    assert token_ids(llm, longer, GREEDY) == token_ids(base, longer, GREEDY)
    assert llm.llm_engine.engine_core.get_stats().prefix_cache_hits > hits_before
    assert_clean(llm)


def test_greedy_equal_under_preemption(folder) -> None:
    ps = prompts(8)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    want = token_ids(make_llm(folder, None), ps, GREEDY)
    llm = make_llm(folder, spec, num_blocks=40, kv_cache_memory=None)
    assert token_ids(llm, ps, GREEDY) == want
    assert llm.llm_engine.engine_core.get_stats().num_preemptions > 0
    assert_both_paths(llm)
    assert_clean(llm)


def test_sampling_rules_logprobs_stops_and_n(folder) -> None:
    """Greedy requests with processors (logit bias, penalties, min_tokens), logprobs, a
    stop token inside accepted runs and n = 2 give what they give without speculation;
    a seeded sampled request is reproducible with speculation on."""
    ps = prompts(6)
    want_base = token_ids(make_llm(folder, None), [ps[3]], GREEDY)[0][0]
    stop_tok = want_base[25]  # a token of the looping tail
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={5: 3.0}, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3,
                       frequency_penalty=0.2),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.0, max_tokens=30, n=2),
        SamplingParams(temperature=0.8, top_k=8, max_tokens=30, seed=7),
    ]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    base = make_llm(folder, None)
    llm = make_llm(folder, spec)
    want = base.generate(ps, params, use_tqdm=False)
    got = llm.generate(ps, params, use_tqdm=False)
    for i in range(5):
        assert [c.token_ids for c in got[i].outputs] == [c.token_ids for c in want[i].outputs]
    assert got[3].outputs[0].finish_reason == "stop"
    for a, b in zip(got[0].outputs[0].logprobs, want[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
            assert a[t].rank == b[t].rank
    again = llm.generate(ps, params, use_tqdm=False)
    assert again[5].outputs[0].token_ids == got[5].outputs[0].token_ids
    assert_both_paths(llm)
    assert_clean(llm)


def test_abort_mid_verification_frees_every_block(folder) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = make_llm(folder, spec)
    core = llm.llm_engine.engine_core
    ps = prompts(4)
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=60))
            for i, p in enumerate(ps)]
    for r in reqs:
        core.add_request(r)
    for _ in range(200):
        sched = core.scheduler.schedule()
        if sched.scheduled_spec_token_ids:
            break  # drafts scheduled for verification
        core.scheduler.update_from_output(sched, core.executor.execute_model(sched))
    assert sched.scheduled_spec_token_ids, "no step verified draft tokens"
    victim = next(r for r in reqs if r.request_id in sched.scheduled_spec_token_ids)
    core.abort_requests([victim.request_id])
    out = core.executor.execute_model(sched)
    core.scheduler.update_from_output(sched, out)
    run(core)
    assert victim.get_finish_reason() == "abort"
    assert_clean(llm)


# -- draft model -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory) -> str:
    """The target's weights with noise: a draft that agrees often, not always."""
    path = str(tmp_path_factory.mktemp("spec-draft"))
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=128, max_len=MAX_LEN,
                         special_tokens=False)
    model = tiny_hf_model(config, std=0.1, seed=3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.04)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_model_greedy_equals_greedy_without(folder, draft_folder, k) -> None:
    ps = prompts()
    want = token_ids(make_llm(folder, None, max_num_batched_tokens=48), ps, GREEDY)
    spec = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": k}
    llm = make_llm(folder, spec, max_num_batched_tokens=48)
    assert token_ids(llm, ps, GREEDY) == want
    assert_both_paths(llm)
    assert_clean(llm)


def test_draft_model_under_preemption_and_its_blocks(folder, draft_folder) -> None:
    """The draft's cache shares the target's block tables: a forced preemption and
    prefix hits leave the output unchanged and every block free."""
    ps = prompts(8)
    spec = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": 3}
    want = token_ids(make_llm(folder, None), ps, GREEDY)
    llm = make_llm(folder, spec, num_blocks=40, kv_cache_memory=None)
    assert token_ids(llm, ps, GREEDY) == want
    assert token_ids(llm, ps, GREEDY) == want  # again, over cached prefixes
    stats = llm.llm_engine.engine_core.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert_both_paths(llm)
    assert_clean(llm)


def test_draft_model_counts_in_the_kv_budget(folder, draft_folder) -> None:
    budget = 1 << 20
    plain = make_llm(folder, None, kv_cache_memory=budget).llm_engine.engine_core.num_blocks
    spec = {"method": "draft_model", "model": draft_folder}
    with_draft = make_llm(folder, spec, kv_cache_memory=budget).llm_engine.engine_core.num_blocks
    assert with_draft == plain // 2  # the draft's blocks are as large as the target's


def test_draft_model_start_up_errors_name_the_field(folder, tmp_path) -> None:
    other_vocab = tiny_config("LlamaForCausalLM", vocab=VOCAB + 8, hidden=32, ffn=64,
                              max_len=MAX_LEN, special_tokens=False)
    tiny_hf_model(other_vocab).save_pretrained(tmp_path / "vocab")
    short = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=32, ffn=64, max_len=64,
                        special_tokens=False)
    tiny_hf_model(short).save_pretrained(tmp_path / "short")
    cases = [
        ({"model": str(tmp_path / "vocab")}, r"speculative_config\.model: .*vocabulary"),
        ({"model": str(tmp_path / "short")}, r"speculative_config\.model: .*context"),
        ({"model": folder, "max_model_len": 128}, r"speculative_config\.max_model_len"),
        ({"model": str(tmp_path / "missing")}, r"speculative_config\.model"),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            make_llm(folder, {"method": "draft_model", **extra})


def test_a_proposer_can_take_the_target_hidden_states(folder) -> None:
    """The interface an EAGLE / Medusa head needs: one target hidden state per new token."""
    from tandem.engine.spec_decode.ngram import NgramProposer
    from tandem.engine.spec_decode.proposer import ProposeInput

    seen: list[tuple[int, tuple[int, ...]]] = []

    class Recording(NgramProposer):
        uses_hidden_states = True

        def propose(self, inputs: list[ProposeInput]) -> list[list[int]]:
            for inp in inputs:
                assert inp.hidden_states is not None
                seen.append((len(inp.new_token_ids), tuple(inp.hidden_states.shape)))
            return super().propose(inputs)

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = make_llm(folder, spec)
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    runner.proposer = Recording(runner.config.speculative)
    want = token_ids(make_llm(folder, None), prompts(4), GREEDY)
    assert token_ids(llm, prompts(4), GREEDY) == want
    assert seen and all(shape == (n, 64) for n, shape in seen)
    assert any(n > 1 for n, _ in seen)  # accepted runs give several states


# -- draft model, random requests: drafts drawn from the draft's q ---------------------


def acceptance_rate(llm: LLM) -> float:
    st = llm.llm_engine.engine_core.get_stats().spec_decode
    assert st.num_draft_tokens > 0
    return st.num_accepted_tokens / st.num_draft_tokens


def test_draft_model_samples_from_q_and_is_accepted_by_ratio(folder, monkeypatch) -> None:
    """The target as its own draft at temperature 1: drafts drawn from q = p are accepted
    with probability min(1, p / q) = 1; point masses on the draft's argmax (what a greedy
    draft proposes) only with probability p(argmax)."""
    import tandem.engine.spec_decode.draft_model as draft_model
    from tandem.engine.sampler import Sampler

    ps = prompts(8)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 3,
            "acceptance_backoff": False}
    llm = make_llm(folder, spec)
    first = token_ids(llm, ps, params)
    with_q = acceptance_rate(llm)
    assert with_q > 0.99  # only float rounding between the two forwards can reject
    # Seeded: the draft's draws too are keyed by (seed, position), not by the batch.
    assert token_ids(llm, ps[::-1], params) == first[::-1]
    assert_clean(llm)

    class PointMass(Sampler):  # the draft's q only: onehot(argmax), a greedy draft
        @staticmethod
        def target_probs(processed, requests):
            out = torch.zeros_like(processed)
            return out.scatter_(1, processed.argmax(dim=1, keepdim=True), 1.0)

    monkeypatch.setattr(draft_model, "Sampler", PointMass)
    argmax_llm = make_llm(folder, spec)
    argmax_llm.generate(ps, params, use_tqdm=False)
    assert acceptance_rate(argmax_llm) < 0.8 * with_q


def test_the_draft_and_the_target_draw_unseeded_keys_from_different_streams(
        folder, draft_folder) -> None:
    """Bug pinned: both generators were PCG64(engine seed), so a draft token and the
    target's token drawn after it often shared their race key; speculative sampling is
    exact only with independent noise (an unseeded draft then repeated the previous
    token 20% of the time where its distribution said 5%)."""
    from tandem.engine.categorical import row_keys

    spec = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": 2}
    llm = make_llm(folder, spec)
    runner = llm.llm_engine.engine_core.executor.driver_worker.model_runner
    target = set(row_keys([None] * 1000, runner.sampler.noise_generator).tolist())
    draft = set(row_keys([None] * 1000, runner.proposer.noise_generator).tolist())
    assert len(target) == len(draft) == 1000 and not target & draft
