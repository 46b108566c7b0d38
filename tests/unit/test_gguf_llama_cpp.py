"""The default GGUF run on its own blocks (``quantization="gguf"``) against llama.cpp on the
same file (llama-cpp-python, the ``bench`` extra; skipped where it is not installed):
greedy tokens close by vLLM's rule (at the first position where they differ, each side's
token is in the other's top-5 logprobs), fed the same token ids."""

from __future__ import annotations

import pytest

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the bench extra")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "List three colors:"]
NEW_TOKENS = 8
TOP = 5


def _llama_cpp_greedy(path: str, prompt: list[int]) -> tuple[list[int], list[set[int]]]:
    """llama.cpp's greedy continuation of ``prompt`` and each step's top-5 token ids."""
    import numpy as np

    # logits_all: llama-cpp-python fills its score rows per evaluated token only then
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, logits_all=True,
                          verbose=False)
    llm.eval(prompt)
    tokens: list[int] = []
    tops: list[set[int]] = []
    for _ in range(NEW_TOKENS):
        logits = np.asarray(llm.scores[llm.n_tokens - 1])
        order = np.argsort(-logits)
        tokens.append(int(order[0]))
        tops.append({int(t) for t in order[:TOP]})
        llm.eval([tokens[-1]])
    llm.close()
    return tokens, tops


@pytest.mark.slow
def test_native_gguf_close_to_llama_cpp_on_the_same_file():
    from tandem.engine.llm import LLM
    from tandem.engine.model_files import default_model_path
    from tandem.engine.sampling_params import SamplingParams

    path = default_model_path()
    llm = LLM(quantization="gguf", dtype="float32", kv_cache_memory=1 << 26)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True)
    ours = [o.outputs[0] for o in llm.generate(ids, sp,
                                                use_tqdm=False)]
    compared = 0
    for prompt, out in zip(ids, ours, strict=True):
        theirs, their_tops = _llama_cpp_greedy(path, prompt)
        for i, (a, b) in enumerate(zip(out.token_ids, theirs, strict=True)):
            compared += 1
            if a != b:
                assert b in out.logprobs[i] and a in their_tops[i], (i, out.token_ids, theirs)
                break
    assert compared >= len(PROMPTS)
