"""Offline ``LLM`` on tiny random-weight Gemma 2, Gemma 3 (text) and Phi-3 models served by
tandem's native implementations (``engine/models/gemma.py``, ``engine/models/phi3.py``).

Each model is built by transformers from its config class (no download), saved as a local
Hugging Face folder and loaded by path. Oracle: transformers' ``generate(do_sample=False)``
in float32, token for token, on prompts that go through chunked prefill (16-token steps)
in a KV cache small enough to preempt, then again with prefix-cache hits. Sliding windows
of 8 tokens, so both layer kinds matter within the prompts. Also: PP=2 on a tiny Gemma 2,
TP=2 on Gemma 3 and Phi-3, and bf16 native against the Transformers modeling backend on
the same checkpoint.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import pytest
import torch
import transformers
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps, tiny_hf_model

from tandem import LLM, SamplingParams

VOCAB = 256
MAX_LEN = 256
NEW_TOKENS = 10
BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": MAX_LEN,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
# Untied: with a tied head these tiny Gemmas mostly repeat a prompt token (the scaled
# embedding dominates the stream), which would test little; the unit tests cover tied.
GEMMA = {"head_dim": 16, "sliding_window": 8, "final_logit_softcapping": 8.0,
         "tie_word_embeddings": False}
#: LongRoPE over a rotary dimension of 8 (half of the 16-wide heads: partial rotary)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(4)],
            "long_factor": [1.0 + 1.5 * i for i in range(4)]}

#: name -> (config, weight std, engine context, prompt lengths)
MODELS: dict[str, tuple[Any, float, int, list[int]]] = {
    "gemma2": (transformers.Gemma2Config(**BASE, **GEMMA, attn_logit_softcapping=4.0,
                                         architectures=["Gemma2ForCausalLM"]),
               0.2, MAX_LEN, [1, 3, 17, 45]),
    "gemma3": (transformers.Gemma3TextConfig(
        **BASE, **GEMMA, architectures=["Gemma3ForCausalLM"],
        layer_types=["sliding_attention", "full_attention"] * 2), 0.2, MAX_LEN, [1, 3, 17, 45]),
    "phi3": (transformers.Phi3Config(**BASE, architectures=["Phi3ForCausalLM"]),
             0.2, MAX_LEN, [1, 3, 17, 45]),
    # LongRoPE, the context (256) beyond original_max_position_embeddings (32): long
    # factors; prompts past 32 tokens, where transformers takes them too
    "phi3-longrope": (transformers.Phi3Config(
        **BASE, architectures=["Phi3ForCausalLM"], original_max_position_embeddings=32,
        rope_scaling=dict(LONGROPE), partial_rotary_factor=0.5, sliding_window=8),
        0.2, MAX_LEN, [33, 40, 57]),
    # the same checkpoint served within 32 tokens: the short factors
    "phi3-longrope-short": (transformers.Phi3Config(
        **BASE, architectures=["Phi3ForCausalLM"], original_max_position_embeddings=32,
        rope_scaling=dict(LONGROPE), partial_rotary_factor=0.5, sliding_window=8),
        0.2, 32, [1, 3, 9, 21]),
}


def prompts(lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def save_tiny(name: str, folder: str, **overrides: Any) -> transformers.PreTrainedModel:
    """``MODELS[name]``'s checkpoint in ``folder``; ``overrides``: config fields and ``std``."""
    config, std, _, _ = MODELS[name]
    std = overrides.pop("std", std)
    if overrides:
        config = type(config)(**{**config.to_dict(), **overrides})
    gemma = config.model_type.startswith("gemma")
    # both LongRoPE cases share one checkpoint (the seed of "phi3-longrope")
    seed = zlib.crc32(name.removesuffix("-short").encode()) % 1000
    hf = tiny_hf_model(config, std=std, norms=(-0.3, 0.3) if gemma else (0.7, 1.3), seed=seed)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module", params=list(MODELS), ids=list(MODELS))
def tiny(request, tmp_path_factory) -> tuple[str, str, transformers.PreTrainedModel]:
    folder = str(tmp_path_factory.mktemp(request.param))
    return request.param, folder, save_tiny(request.param, folder)


def test_greedy_matches_transformers_with_chunks_preemption_and_prefix_hits(tiny) -> None:
    """Every prompt's greedy tokens equal transformers' ``generate``: in one batch with
    16-token chunked prefill in a cache too small for all (preemption), then again on
    the same engine (prefix-cache hits)."""
    name, folder, hf = tiny
    _, _, context, lens = MODELS[name]
    blocks = sum(-(-(n + NEW_TOKENS) // 4) for n in lens) - 6  # a few blocks short of all
    llm = LLM(model=folder, dtype="float32", max_model_len=context, block_size=4,
              num_blocks=blocks, max_num_batched_tokens=16)
    core = llm.llm_engine.engine_core
    model = core.executor.driver_worker.model_runner.model
    assert type(model).__name__ == hf.config.architectures[0]  # native: registry "auto"
    assert core.model_facts.model_impl == "tandem"
    ps = prompts(lens)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    first = llm.generate(ps, params, use_tqdm=False)
    assert core.get_stats().num_preemptions > 0, "the small KV cache must force preemption"
    again = llm.generate(ps, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) >= 16  # full blocks the cache kept
    # weights that saturate the model give one token everywhere: no test of the layers
    assert len({t for o in first for t in o.outputs[0].token_ids}) >= 8
    for prompt, a, b in zip(ps, first, again, strict=True):
        ref, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(a.outputs[0].token_ids), ref, logits)
        assert_matches_hf(list(b.outputs[0].token_ids), ref, logits)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize(("name", "tp", "pp"), [("gemma2", 1, 2), ("gemma3", 2, 1),
                                                ("phi3-longrope", 2, 1)],
                         ids=["gemma2-pp2", "gemma3-tp2", "phi3-longrope-tp2"])
def test_parallel_equals_transformers(tmp_path, name: str, tp: int, pp: int) -> None:
    """Two ranks (one worker process each, gloo). PP=2: the residual stream crosses the
    stage boundary between a sliding and a global layer, and a tied head on the last stage
    keeps its own copy of the (unscaled) embedding. TP=2: each rank its heads, MLP slice
    and vocabulary shard, the final softcap after the gather; Phi-3's fused checkpoint
    tensors cut into each rank's q/k/v and gate/up rows."""
    folder = str(tmp_path)
    tied = {"tie_word_embeddings": True, "std": 0.1} if pp > 1 else {}
    hf = save_tiny(name, folder, **tied)
    lens = MODELS[name][3]
    with LLM(model=folder, dtype="float32", max_model_len=MAX_LEN, num_blocks=24,
             max_num_batched_tokens=32, tensor_parallel_size=tp,
             pipeline_parallel_size=pp) as llm:
        assert len(llm.llm_engine.engine_core.executor.worker_pids) == 2
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        ps = prompts(lens)
        for prompt, out in zip(ps, llm.generate(ps, params, use_tqdm=False), strict=True):
            want, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
            assert_matches_hf(list(out.outputs[0].token_ids), want, logits)


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_bfloat16_native_agrees_with_the_transformers_backend(tmp_path, name: str) -> None:
    """bf16, the same checkpoint through tandem's native model and through transformers'
    modeling code (``model_impl="transformers"``): the same greedy tokens, a first
    difference only at a bf16 near-tie of the Transformers backend's top-2 logprobs."""
    folder = str(tmp_path)
    save_tiny(name, folder)
    ps = prompts(MODELS[name][3])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=2)

    def run(impl: str) -> list:
        llm = LLM(model=folder, dtype="bfloat16", max_model_len=MAX_LEN, model_impl=impl,
                  kv_cache_memory=4 << 20)
        try:
            return llm.generate(ps, params, use_tqdm=False)
        finally:
            llm.shutdown()

    native, backend = run("tandem"), run("transformers")
    for a, b in zip(native, backend, strict=True):
        ours, theirs = a.outputs[0].token_ids, b.outputs[0].token_ids
        for i, (x, y) in enumerate(zip(ours, theirs, strict=True)):
            if x != y:
                ranked = sorted(b.outputs[0].logprobs[i].items(), key=lambda kv: -kv[1].logprob)
                (_, top), (second_id, second) = ranked[:2]
                assert x == second_id, f"position {i}: {x} is not the backend's runner-up"
                # logits of a few units, where a bf16 ulp is 1/64 to 1/32
                assert top.logprob - second.logprob <= 4 / 32, f"position {i}: {x} vs {y}"
                break
