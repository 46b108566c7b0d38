"""Speculative decoding behind the OpenAI API: `tandem up --speculative-config` (prompt
lookup on the decode engine), the real default model in float32, the official client.

Oracle: the offline ``LLM`` without speculation. Greedy text must match exactly, streamed
or not, and a stop string must cut the text where it would without speculation (the
prompts quote their text, so the decode engine's drafts are accepted in runs; the same
prompts accept most drafts offline, test_llm_correctness.py).
"""

from __future__ import annotations

import openai
import pytest

from tandem.engine.sampling_params import SamplingParams
from tandem.up import Stack, StackConfig

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 32
TEXT = ("The archive of Eldham held ledgers, maps and letters; every spring the keepers "
        "copied the ledgers by hand before the floods.")
QUESTIONS = [f"Repeat this sentence exactly: {TEXT}", f"Summarize in one sentence: {TEXT}"]
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", str(192 << 20),
               "--max-model-len", "2048"]
SPEC = '{"method": "ngram", "num_speculative_tokens": 3}'


def _chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def oracle():
    from tandem.engine.llm import LLM

    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=2048)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([_chat(q) for q in QUESTIONS], greedy, use_tqdm=False)
    return {q: o.outputs[0] for q, o in zip(QUESTIONS, outs, strict=True)}


@pytest.fixture(scope="module")
def client(redis_url, oracle):
    cfg = StackConfig(num_prefill=1, num_decode=1, port=0, grpc_port=0, redis_url=redis_url,
                      engine_args=ENGINE_ARGS, router_args=["--max-model-len", "2048"],
                      speculative_config=SPEC, startup_timeout_s=600)
    with Stack(cfg) as s:
        yield openai.OpenAI(base_url=f"{s.http_url}/v1", api_key="none", max_retries=0,
                            timeout=300)


def test_greedy_text_matches_without_speculation(client, oracle) -> None:
    for q in QUESTIONS:
        want = oracle[q]
        resp = client.chat.completions.create(model=MODEL, messages=_chat(q),
                                              max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].message.content == want.text, q
        assert resp.usage.completion_tokens == len(want.token_ids)
        stream = client.chat.completions.create(model=MODEL, messages=_chat(q),
                                                max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want.text, q


def test_stop_string_cuts_where_it_would_without(client, oracle) -> None:
    want = oracle[QUESTIONS[0]].text
    words = want.split()
    assert len(words) > 6, want
    stop = words[5]
    resp = client.chat.completions.create(model=MODEL, messages=_chat(QUESTIONS[0]),
                                          max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == want[: want.index(stop)]
