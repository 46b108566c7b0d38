"""``SamplingParams.prompt_logprobs`` on the offline ``LLM`` with a tiny random model.

Oracle: transformers' float32 ``log_softmax`` over the prompt's logits (position ``i``
predicts prompt token ``i + 1``); every entry's logprob within 1e-4, its rank, and the
top-k ids and order. Covered: one whole-prompt step, chunked prefill (a step budget
smaller than the prompt), a prompt whose prefix is in the prefix cache (vLLM's rule:
recomputed, so every entry still exists), several prompts in one batch beside one that
asks for none, and ``prompt_logprobs=0``.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.request import Logprob

VOCAB = 128
MAX_LEN = 256
TOL = 1e-4


@pytest.fixture(scope="module")
def hf():
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=128, max_len=MAX_LEN,
                         special_tokens=False)
    return tiny_hf_model(config, std=0.2, seed=11)


@pytest.fixture(scope="module")
def loaded(hf):
    return as_loaded_model(hf, "tiny-llama-prompt-logprobs", MAX_LEN)


def make_llm(loaded, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 4 << 20)
    return LLM(dtype="float32", loaded=loaded, max_model_len=MAX_LEN, **kwargs)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: float32 log-softmax at positions 0..n-2."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_prompt_logprobs(hf, ids: list[int], got: list[dict[int, Logprob] | None], k: int):
    ref = hf_prompt_logprobs(hf, ids)
    assert len(got) == len(ids)
    assert got[0] is None
    for pos, entry in enumerate(got[1:]):
        assert entry is not None, f"position {pos + 1} has no entry"
        row = ref[pos]
        tok = ids[pos + 1]
        assert abs(entry[tok].logprob - float(row[tok])) < TOL, f"position {pos + 1}"
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = [t for t, lp in entry.items() if lp.rank is not None and lp.rank <= k]
        want = row.topk(k).indices.tolist() if k else []
        # the prompt token (first in the dict) appears once, also when in the top-k
        assert sorted(top, key=lambda t: entry[t].rank) == want, f"position {pos + 1}"
        for t in want:
            assert abs(entry[t].logprob - float(row[t])) < TOL
        assert set(entry) <= set(want) | {tok}


def test_whole_prompt_one_step(hf, loaded):
    llm = make_llm(loaded)
    ids = prompt(40, 1)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=3,
                                             temperature=0.0), use_tqdm=False)[0]
    assert_prompt_logprobs(hf, ids, out.prompt_logprobs, 3)


def test_chunked_prefill(hf, loaded):
    # 16-token steps: a 70-token prompt goes in five chunks
    llm = make_llm(loaded, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    ids = prompt(70, 2)
    out = llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert_prompt_logprobs(hf, ids, out.prompt_logprobs, 2)
    assert len(out.outputs[0].token_ids) == 2


def test_cached_prefix_recomputed(hf, loaded):
    llm = make_llm(loaded)
    ids = prompt(64, 3)
    first = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert first.prompt_logprobs is None
    # without prompt logprobs the prefix is a hit ...
    again = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 48
    # ... with them it is recomputed, so every position has its entry
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert_prompt_logprobs(hf, ids, out.prompt_logprobs, 1)


def test_batch_mixed_and_k0(hf, loaded):
    llm = make_llm(loaded, max_num_batched_tokens=32)
    a, b, c = prompt(30, 4), prompt(1, 5), prompt(45, 6)
    params = [SamplingParams(max_tokens=3, prompt_logprobs=0),
              SamplingParams(max_tokens=3, prompt_logprobs=4),
              SamplingParams(max_tokens=3)]
    outs = llm.generate([a, b, c], params, use_tqdm=False)
    assert_prompt_logprobs(hf, a, outs[0].prompt_logprobs, 0)
    assert all(len(e) == 1 for e in outs[0].prompt_logprobs[1:])
    assert outs[1].prompt_logprobs == [None]  # one token: nothing predicts it
    assert outs[2].prompt_logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, 1.5])
def test_bad_value_names_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
