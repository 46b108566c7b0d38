"""Tensor and pipeline parallel engines (the "mp" executor: one worker process per rank,
gloo on the CPU) against transformers' greedy ``generate`` in float32, token for token,
through the offline ``LLM``: a mixed batch with chunked prefill, prefix-cache hits and
preemption; and a worker killed mid-batch fails the engine fast, leaving no process or
shared-memory segment behind. At PP=2 the engine keeps two batches in flight (the batch
queue), and a request aborted while its batch is in flight keeps its blocks until the
batch is applied.

This box has 2 cores, so an engine gets at most 2 workers (one core each): TP=2 and PP=2
are tested here, TP=2 x PP=2 at the model-runner level (test_tensor_parallel.py).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps, tiny_config, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.executor import EngineDeadError

VOCAB = 256
MAX_LEN = 256
NEW_TOKENS = 10

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Llama whose 4 query heads share 1 KV head: at TP=2 each rank holds a replica."""
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=128, heads=4,
                         kv_heads=1, layers=4, max_len=MAX_LEN, special_tokens=False)
    hf = tiny_hf_model(config, std=0.2, seed=11)
    folder = str(tmp_path_factory.mktemp("tiny-tp"))
    hf.save_pretrained(folder)
    return folder, hf


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    # Two prompts share 40 tokens (prefix-cache hits on the second), lengths across
    # block and chunk edges.
    lens = [1, 17, 45, 90]
    rest = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
    return rest + [shared + [1, 2, 3], shared + [4, 5, 6, 7, 8]]


def _left(segments: list[str]) -> list[str]:
    """The shared-memory segments among ``segments`` that still exist."""
    return [name for name in segments if os.path.exists(f"/dev/shm/{name.lstrip('/')}")]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_greedy_equals_transformers(tiny, tp: int, pp: int) -> None:
    folder, hf = tiny
    # 10 blocks of 16 tokens for 6 requests growing to 1-7 blocks: preemption; a
    # 32-token step budget: the long prompts are chunked.
    with LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, num_blocks=10,
             max_num_batched_tokens=32, tensor_parallel_size=tp,
             pipeline_parallel_size=pp) as llm:
        core = llm.llm_engine.engine_core
        pids = core.executor.worker_pids
        segments = core.executor.shm_segments
        assert len(pids) == 2 and len(segments) == 3 and _left(segments) == segments
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts(), params, use_tqdm=False)
        for prompt, out in zip(prompts(), outs, strict=True):
            want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
            assert_matches_hf(list(out.outputs[0].token_ids), want, logits)
        stats = core.get_stats()
        assert stats.prefix_cache_hits > 0
        assert stats.num_preemptions > 0, "the test must preempt"
        # Alone, the same tokens as in the batch.
        alone = llm.generate([prompts()[3]], params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == outs[3].outputs[0].token_ids
        if pp > 1:
            assert core.max_concurrent_batches == pp
            assert core.max_num_batches_in_flight == pp, "the stages never overlapped"
            _abort_in_flight(llm, hf, params)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _left(segments) == []


def _abort_in_flight(llm: LLM, hf, params: SamplingParams) -> None:
    """Abort a request of the oldest of two batches in flight: its blocks stay held
    until that batch is applied, the others still equal transformers, and every block
    is free at the end."""
    engine = llm.llm_engine
    core = engine.engine_core
    kvm = core.scheduler.kv_cache_manager
    for i, prompt in enumerate(prompts()[:4]):
        engine.add_request(f"abort-{i}", prompt, params)
    engine.step()
    assert core.num_batches_in_flight == 1
    held = kvm.get_block_ids("abort-0")
    assert held, "the first batch admits the first request"
    engine.step()
    assert core.num_batches_in_flight == 2, "the second batch went out before the first came back"
    engine.abort_request("abort-0")
    assert kvm.get_block_ids("abort-0") == held, "freed under the batch in flight"
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert kvm.get_block_ids("abort-0") == []
    for i, prompt in enumerate(prompts()[1:4], start=1):
        want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(last[f"abort-{i}"].outputs[0].token_ids), want, logits)
    assert kvm.num_free_blocks == kvm.num_total_blocks


def test_killed_worker_fails_the_engine_fast(tiny) -> None:
    folder, _ = tiny
    llm = LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=4 << 20,
              tensor_parallel_size=2)
    pids = llm.llm_engine.engine_core.executor.worker_pids
    segments = llm.llm_engine.engine_core.executor.shm_segments
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("a", prompts()[2], params)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="worker process 1 .* died"):
        while engine.has_unfinished_requests():
            engine.step()
    with pytest.raises(EngineDeadError):
        engine.step()  # dead stays dead
    llm.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _left(segments) == [], "the killed worker's reply queue is removed too"
