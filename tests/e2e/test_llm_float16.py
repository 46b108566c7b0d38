"""``LLM(dtype="float16")`` on a tiny random-weight model: every sampling path runs.

A float16 model hands the sampler float16 logits; the fused temperature-only race once
refused them ("logits must be float32 or bfloat16"), so every sampled request of a
float16 engine failed (issue 36). Greedy, temperature-only, truncated (top-p) and
logprobs requests must all generate, and a seeded request must repeat itself.
"""

from __future__ import annotations

import pytest
from tiny_models import tiny_config, tiny_hf_model

from tandem import LLM, SamplingParams

VOCAB = 256
MAX_LEN = 128
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    folder = str(tmp_path_factory.mktemp("fp16"))
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=128, max_len=MAX_LEN,
                         special_tokens=False)
    tiny_hf_model(config, std=0.2, seed=3).save_pretrained(folder)
    return LLM(model=folder, dtype="float16", max_model_len=MAX_LEN, kv_cache_memory=4 << 20)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=0.8, seed=11, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=0.8, logprobs=2, seed=11, max_tokens=NEW_TOKENS),
    ],
    ids=["greedy", "temperature", "top_p", "logprobs"],
)
def test_float16_engine_samples_every_way(llm: LLM, params: SamplingParams) -> None:
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, again, strict=True):
        assert len(a.outputs[0].token_ids) == NEW_TOKENS
        assert all(0 <= t < VOCAB for t in a.outputs[0].token_ids)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # greedy or seeded
        if params.logprobs is not None:
            assert a.outputs[0].logprobs is not None
            assert len(a.outputs[0].logprobs) == NEW_TOKENS

