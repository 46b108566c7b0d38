"""Tensor and expert parallelism on tiny MoE models (the "mp" executor, gloo on the CPU):
TP=2 (each rank a slice of every expert) and EP=2 (``enable_expert_parallel``: each rank
half the experts whole) equal one rank's output, i.e. transformers' float32 greedy
``generate``, token for token, in a batch with chunked prefill, prefix-cache hits and
preemption; PP=2 too; experts that do not divide over the ranks fail at start-up naming
the field.

Qwen2-MoE covers the shared expert and its gate (TP-sliced like the dense MLP beside the
routed partial sums); gpt-oss the experts' biases (whole on the rank that holds the
expert under EP, on TP rank 0 only under TP) and the attention sinks of each rank's heads.
"""

from __future__ import annotations

import os

import pytest
from test_llm_moe_models import build_moe, prompts
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps

from tandem import LLM, SamplingParams

MAX_LEN = 256
NEW_TOKENS = 8

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@pytest.fixture(scope="module", params=["Qwen2MoeForCausalLM", "GptOssForCausalLM"])
def tiny(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"{request.param}-par"))
    return folder, build_moe(request.param, folder)


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_moe_parallel_equals_one_rank(tiny, ep: bool) -> None:
    folder, hf = tiny
    with LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, block_size=8, num_blocks=12,
             max_num_batched_tokens=16, tensor_parallel_size=2,
             enable_expert_parallel=ep) as llm:
        assert llm.llm_engine.engine_core.executor.config.parallel.enable_expert_parallel is ep
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts(), params, use_tqdm=False)
        for prompt, out in zip(prompts(), outs, strict=True):
            want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
            assert_matches_hf(list(out.outputs[0].token_ids), want, logits)
        stats = llm.llm_engine.engine_core.get_stats()
        assert stats.prefix_cache_hits > 0
        assert stats.num_preemptions > 0, "the test must preempt"


def test_moe_pipeline_parallel_equals_one_rank(tiny) -> None:
    """PP=2: each stage runs its MoE layers whole (docs/models.md says PP for MoE)."""
    folder, hf = tiny
    with LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=4 << 20,
             max_num_batched_tokens=16, pipeline_parallel_size=2) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts(), params, use_tqdm=False)
    for prompt, out in zip(prompts(), outs, strict=True):
        want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(out.outputs[0].token_ids), want, logits)


def test_experts_not_divisible_fail_at_start(tmp_path) -> None:
    build_moe("Qwen3MoeForCausalLM", str(tmp_path), num_experts=5)
    with pytest.raises(ValueError, match="enable_expert_parallel: num_experts 5 must be divis"):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=MAX_LEN,
            kv_cache_memory=4 << 20, tensor_parallel_size=2, enable_expert_parallel=True)
