"""Prefill -> KV store -> decode for an MLA model (a tiny random DeepSeek-V3), over real
gRPC services, a real UCX store node and a real Redis (the conftest's fixtures, with this
module's ``tiny`` model).

The store moves the latent: a published block is ``num_layers x block_size x
(kv_lora_rank + qk_rope_head_dim)`` elements, and its key carries the MLA layout's
fingerprint, so an engine of another layout (e.g. the Transformers backend of the same
checkpoint, which caches expanded per-head K/V) misses it instead of misreading it.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from services_harness import (
    hf_greedy,
    params,
    run_colocated,
    run_disaggregated,
    wait_published,
)

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout, KVCacheSpec

#: Flags of the module's prefill and decode services (conftest's fixtures read it).
ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]
VOCAB, RANK, ROPE, LAYERS, BLOCK = 512, 32, 8, 2, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny DeepSeek-V3 folder (float32 safetensors, no tokenizer): a dense layer then a
    MoE one, low-rank query, YaRN."""
    import transformers
    from tiny_models import tiny_hf_model

    folder = Path(tmp_path_factory.mktemp("mla")) / "tiny-deepseek-v3"
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        kv_lora_rank=RANK, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=ROPE,
        v_head_dim=12, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        architectures=["DeepseekV3ForCausalLM"], bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "mscale": 1.0,
                         "mscale_all_dim": 1.0})
    tiny_hf_model(config, std=0.2, seed=5).save_pretrained(folder)
    return str(folder)


def mla_layout(model_dir: str) -> KVCacheLayout:
    return KVCacheLayout.of_spec(KVCacheSpec.mla(RANK, ROPE), model_id=Path(model_dir).name,
                                 num_layers=LAYERS, dtype="float32", block_size=BLOCK)


def test_disaggregated_equals_colocated_and_transformers(tiny, prefill, decode):
    rng = random.Random(0)
    # below one block, a partial last block, chunked on both sides (> 64 tokens)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 37, 150)]
    expected = hf_greedy(tiny, prompts, max_new_tokens=10)
    for prompt, want in zip(prompts, expected, strict=True):
        got, pre = run_disaggregated(prefill, decode, prompt, params(10))
        assert got == want, f"disaggregated, prompt of {len(prompt)} tokens"
        assert pre.kv_layout_fingerprint == mla_layout(tiny).fingerprint
        assert run_colocated(decode, prompt, params(10)) == want, "colocated"


def test_published_blocks_are_the_latent_and_other_layouts_miss(tiny, prefill, decode,
                                                                 redis_url, store):
    from tandem.kvstore.client import KVStoreClient

    prompt = [random.Random(1).randrange(VOCAB) for _ in range(48)]
    _, pre = run_disaggregated(prefill, decode, prompt, params(2))
    wait_published(redis_url, pre)
    layout = mla_layout(tiny)
    keys = [BlockKey(h, pre.kv_layout_fingerprint) for h in pre.block_hashes]
    assert len(keys) == 3
    client = KVStoreClient(redis_url, layout=layout, timeout_s=10)
    plain = KVStoreClient(redis_url, timeout_s=10)  # no layout: any key may be asked
    try:
        # A layout-checked get fills buffers of exactly the latent's bytes per block.
        blocks = [torch.zeros(layout.block_shape) for _ in keys]
        assert client.get_blocks(keys, blocks) == len(keys)
        assert layout.block_bytes == LAYERS * BLOCK * (RANK + ROPE) * 4
        assert all(b.abs().sum() > 0 for b in blocks)
        assert plain.contains(keys) == [True] * 3
        # The same blocks under per-head K/V layouts of this model (the Transformers
        # backend's expanded geometry, and two of the latent's bytes per block): a miss.
        for heads, dim in [(4, 24), (1, RANK + ROPE), (1, (RANK + ROPE) // 2)]:
            mha = KVCacheLayout.of_spec(KVCacheSpec.mha(heads, dim), model_id=layout.model_id,
                                        num_layers=LAYERS, dtype="float32", block_size=BLOCK)
            other = [BlockKey(h, mha.fingerprint) for h in pre.block_hashes]
            assert plain.contains(other) == [False] * 3
            assert plain.lookup(other) == 0
            with pytest.raises(ValueError, match="layout fingerprint"):
                client.contains(other)  # a client of the MLA layout refuses other keys
    finally:
        plain.close()
        client.close()
