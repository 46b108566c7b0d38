"""Prefill -> KV store -> decode for the model families beyond the dense Llama: a model
with sliding-window layers and a mixture-of-experts model, over real gRPC services, a real
UCX store node and a real Redis (the conftest's fixtures, started once per model).

Disaggregated greedy tokens equal colocated ones and transformers' ``generate``. The dense
case is test_services_disagg.py; the MLA case test_services_disagg_mla.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from services_harness import hf_greedy, params, run_colocated, run_disaggregated

#: Flags of the module's prefill and decode services (conftest's fixtures read it).
ENGINE_ARGS = ["--max-num-batched-tokens", "64", "--num-kv-blocks", "256", "--block-size", "16"]
VOCAB = 512

#: name -> (config class, its fields beyond the common ones)
FAMILIES = {
    # every other layer sliding, window 24: the 150-token prompt crosses it on both sides
    # (an untied head: a tiny tied Gemma mostly repeats a prompt token)
    "sliding-window": ("Gemma2Config", {"head_dim": 16, "sliding_window": 24,
                                        "tie_word_embeddings": False,
                                        "architectures": ["Gemma2ForCausalLM"]}),
    "moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                               "moe_intermediate_size": 32, "head_dim": 16,
                               "architectures": ["Qwen3MoeForCausalLM"]}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight folder of the family (float32 safetensors, no tokenizer)."""
    import transformers
    from tiny_models import tiny_hf_model

    cls, extra = FAMILIES[request.param]
    config = getattr(transformers, cls)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    folder = Path(tmp_path_factory.mktemp(request.param)) / f"tiny-{request.param}"
    tiny_hf_model(config, std=0.2, seed=3).save_pretrained(folder)
    return str(folder)


def test_disaggregated_equals_colocated_and_transformers(tiny, prefill, decode):
    rng = random.Random(0)
    # below one block, a partial last block, chunked on both sides (> 64 tokens)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 37, 150)]
    expected = hf_greedy(tiny, prompts, max_new_tokens=10)
    assert len({t for out in expected for t in out}) > 3, "a degenerate model tests nothing"
    for prompt, want in zip(prompts, expected, strict=True):
        got, _ = run_disaggregated(prefill, decode, prompt, params(10))
        assert got == want, f"disaggregated, prompt of {len(prompt)} tokens"
        assert run_colocated(decode, prompt, params(10)) == want, "colocated"
