"""Offline ``LLM`` on tiny random-weight MoE models of every native MoE family (Qwen3-MoE,
Qwen2-MoE, Mixtral, gpt-oss): hidden 64, 2 layers, 8 experts top-2, vocabulary 256.

Each is built by transformers from its config, saved as a Hugging Face folder (the
per-expert checkpoint names transformers writes, e.g. Mixtral's ``block_sparse_moe``) and
served by tandem's native implementation. Oracle: transformers ``generate(do_sample=False)``
in float32, token for token, in a batch with chunked prefill, prefix-cache hits and
preemption.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import transformers
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps, tiny_config, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.models.moe import SparseMoeBlock

VOCAB = 256
MAX_LEN = 256
NEW_TOKENS = 10

#: architecture -> its MoE config fields (8 experts, top-2)
MOE_ARCHS: dict[str, dict] = {
    "Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True),
    "Qwen2MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48),
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2),
    # head_dim 16 and a 16-token window: the 40+ token prompts cross it.
    "GptOssForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16,
                              sliding_window=16),
}


def build_moe(arch: str, folder: str, layers: int = 2, **extra) -> transformers.PreTrainedModel:
    """The tiny float32 MoE of ``arch``, saved to ``folder``."""
    config = tiny_config(arch, vocab=VOCAB, hidden=64, ffn=64, max_len=MAX_LEN, layers=layers,
                         special_tokens=False, **{**MOE_ARCHS[arch], **extra})
    model = tiny_hf_model(config, std=0.2, seed=zlib.crc32(arch.encode()) % 1000)
    model.save_pretrained(folder)
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    rest = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 3, 17, 45)]
    # The last two share 40 tokens: the second hits the prefix cache.
    return rest + [shared + [1, 2, 3], shared + [4, 5, 6, 7, 8]]


@pytest.fixture(scope="module", params=list(MOE_ARCHS))
def tiny(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    return folder, build_moe(request.param, folder)


def test_moe_greedy_matches_transformers(tiny) -> None:
    folder, hf = tiny
    # 12 blocks of 8 tokens for 6 requests growing to 2-7 blocks: preemption; a 16-token
    # step budget: chunked prefills.
    llm = LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, block_size=8, num_blocks=12,
              max_num_batched_tokens=16)
    model = llm.llm_engine.engine_core.executor.driver_worker.model_runner.model
    assert type(model).__name__ == hf.config.architectures[0], "the native class serves it"
    assert any(isinstance(m, SparseMoeBlock) for m in model.modules())
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    for prompt, out in zip(prompts(), outs, strict=True):
        want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(out.outputs[0].token_ids), want, logits)
    stats = llm.llm_engine.engine_core.get_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0, "the test must preempt"


def test_qwen3_moe_dense_layers_between_sparse(tmp_path) -> None:
    """``decoder_sparse_step`` 2 and ``mlp_only_layers``: dense MLP layers beside the sparse
    ones, as transformers places them."""
    folder = str(tmp_path)
    hf = build_moe("Qwen3MoeForCausalLM", folder, layers=3, decoder_sparse_step=2,
                   mlp_only_layers=[2])
    llm = LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=4 << 20)
    model = llm.llm_engine.engine_core.executor.driver_worker.model_runner.model
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [False, True, False]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(prompts()[:3], llm.generate(prompts()[:3], params, use_tqdm=False),
                           strict=True):
        want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(out.outputs[0].token_ids), want, logits)
