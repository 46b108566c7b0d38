"""The real default model (SmolLM2-135M-Instruct, GGUF) through prefill -> store -> decode.

Float32 greedy output equals transformers ``generate(do_sample=False)`` token for token.
Loads the model three times (two services + the oracle), once per module.
"""

from __future__ import annotations

import pytest
from services_harness import (
    EngineService,
    KVStoreNode,
    hf_greedy,
    params,
    run_disaggregated,
)

pytestmark = pytest.mark.slow

ARGS = ["--kv-cache-memory", str(256 << 20), "--max-model-len", "2048"]


def test_real_model_disaggregated_greedy_matches_transformers(redis_url, tmp_path):
    from tandem.engine.model_files import load_tokenizer

    tok = load_tokenizer(None)
    chats = [
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        [{"role": "user", "content": "Write a haiku about the sea, with lots of detail please."}],
    ]
    texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    store = KVStoreNode(redis_url, tmp_path)
    prefill = decode = None
    try:
        prefill = EngineService("prefill", None, tmp_path, redis_url, ARGS, 600)
        decode = EngineService("decode", None, tmp_path, redis_url, ARGS, 600)
        got = [run_disaggregated(prefill, decode, p, params(24))[0] for p in prompts]
    finally:
        for svc in (decode, prefill):
            if svc is not None:
                svc.stop()
        store.stop()
    assert got == hf_greedy(None, prompts, max_new_tokens=24)
