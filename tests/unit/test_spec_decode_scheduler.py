"""The scheduler under speculative decoding, with a fake runner that plays a target
model and a proposer whose drafts are right for a random number of tokens, then wrong.

The runner writes a prefix-dependent value into each KV slot it computes (drafts
included) and checks, before every step, that every computed slot holds the value of
the request's real tokens: so rollback after rejections, prefix-cache hits and recompute
after preemption are checked for content. The output must be the target's own chain
(what greedy decoding without speculation gives), and every block free at the end.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_decode.rejection_sampler import greedy_accept

BS = 4


def target(prefix: list[int]) -> int:
    """The fake target's greedy next token."""
    return (prefix[-1] * 7 + len(prefix)) % 50


def kv_value(prefix: list[int]) -> float:
    return float(hash(tuple(prefix)) % (1 << 40))


class SpecRunner:
    """``lookahead_slots``: the table must also hold the proposals' slots (a draft
    model writes its own KV there)."""

    def __init__(self, num_blocks: int, seed: int, lookahead_slots: bool) -> None:
        self.kv = torch.full((num_blocks, BS), -1.0, dtype=torch.float64)
        self.rng = random.Random(seed)
        self.lookahead_slots = lookahead_slots

    def __call__(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        for req in so.scheduled_requests:
            rid = req.request_id
            table, start = so.block_tables[rid], req.num_computed_tokens
            drafts = so.scheduled_spec_token_ids.get(rid, [])
            n = so.num_scheduled_tokens[rid]
            fed = req.all_token_ids[: start + n - len(drafts)] + drafts
            ahead = so.num_lookahead_tokens.get(rid, 0) if self.lookahead_slots else 0
            assert len(table) * BS >= start + n + ahead, f"{rid}: table too short"
            for pos in range(start):
                want = kv_value(req.all_token_ids[: pos + 1])
                assert self.kv[table[pos // BS], pos % BS] == want, f"{rid}: stale KV at {pos}"
            for pos in range(start, start + n):
                self.kv[table[pos // BS], pos % BS] = kv_value(fed[: pos + 1])
            if not so.is_sampled(req):
                continue
            base = req.all_token_ids
            argmax = [target(base + drafts[:j]) for j in range(len(drafts) + 1)]
            emitted = greedy_accept(drafts, argmax) if drafts else argmax
            if drafts:
                out.verified_token_ids[rid] = emitted
            else:
                out.sampled_token_ids[rid] = emitted[0]
            k = so.num_lookahead_tokens.get(rid, 0)
            if k:
                seq = base + emitted
                good = self.rng.randrange(0, k + 1)
                proposal = []
                for j in range(k):
                    right = target(seq + proposal)
                    proposal.append(right if j < good else (right + 1) % 50)
                out.draft_token_ids[rid] = proposal
        return out


def chain(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(target(seq))
    return seq[len(prompt):]


def run_all(num_blocks: int, prompts: list[list[int]], max_tokens: int, seed: int,
            method: str = "ngram"):
    # The scheduler only reads the method (the draft model itself lives in the runner).
    model = "/unused" if method == "draft_model" else None
    spec = SpeculativeConfig(method=method, model=model, num_speculative_tokens=4,  # type: ignore[arg-type]
                             acceptance_backoff=False)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8),
        CacheConfig(block_size=BS),
        num_blocks=num_blocks,
        max_model_len=256,
        speculative=spec,
    )
    runner = SpecRunner(num_blocks, seed, lookahead_slots=method == "draft_model")
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.update_from_output(so, runner(so) if not so.is_empty else ModelRunnerOutput())
    return sched, reqs


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_rollback_prefix_cache_and_preemption_keep_kv_and_tokens_exact(method) -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
               [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2], [1, 2, 3, 4, 5, 6, 7, 8]]
    for num_blocks, seed in ((64, 0), (14, 1), (14, 2)):
        sched, reqs = run_all(num_blocks, prompts, 30, seed, method)
        for r, p in zip(reqs, prompts, strict=True):
            assert r.output_token_ids == chain(p, 30), (num_blocks, r.request_id)
            assert r.get_finish_reason() == "length"
        st = sched.get_stats()
        assert 0 < st.spec_decode.num_accepted_tokens < st.spec_decode.num_draft_tokens
        assert st.prefix_cache_hits > 0
        if num_blocks == 14:
            assert st.num_preemptions > 0
        kvm = sched.kv_cache_manager
        assert kvm.num_free_blocks == kvm.num_total_blocks
        assert not kvm.req_to_blocks


def test_max_tokens_inside_an_accepted_run() -> None:
    for max_tokens in (1, 2, 3, 5, 8):
        _, reqs = run_all(64, [[4, 4, 4, 4]], max_tokens, seed=3)
        assert reqs[0].output_token_ids == chain([4, 4, 4, 4], max_tokens)


def test_a_lone_draft_in_a_batch_of_decodes_is_not_verified() -> None:
    """The batch rule (spec_decode/policy.py): drafts are verified only when they number
    at least one per decoding request of the step; else every request decodes one token."""
    spec = SpeculativeConfig(num_speculative_tokens=4, acceptance_backoff=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                      CacheConfig(block_size=BS), num_blocks=64, max_model_len=256,
                      speculative=spec)
    runner = SpecRunner(64, seed=0, lookahead_slots=False)
    reqs = [Request(f"r{i}", [i, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
            for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    so = sched.schedule()  # the prompts; each proposes 4 drafts after its first token
    sched.update_from_output(so, runner(so))
    assert all(len(r.spec_token_ids) == 4 for r in reqs)
    for r in reqs[1:]:
        r.spec_token_ids = []
    reqs[1].spec_token_ids = reqs[0].spec_token_ids[:1]  # 5 drafts for 6 decodes
    so = sched.schedule()
    assert not so.scheduled_spec_token_ids
    assert all(so.num_scheduled_tokens[r.request_id] == 1 for r in reqs)
    sched.update_from_output(so, runner(so))
    assert all(len(r.spec_token_ids) == 4 for r in reqs)
    reqs[1].spec_token_ids = reqs[1].spec_token_ids[:2]
    for r in reqs[2:]:
        r.spec_token_ids = []
    so = sched.schedule()  # 6 drafts for 6 decodes: verified
    assert {rid: len(d) for rid, d in so.scheduled_spec_token_ids.items()} == {"r0": 4, "r1": 2}
    sched.update_from_output(so, runner(so))
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.update_from_output(so, runner(so))
    for r in reqs:
        assert r.output_token_ids == chain(r.prompt_token_ids, 20)
