"""Prompt logprobs through a real router with the official ``openai`` client, colocated
(``--role both``) and disaggregated (prefill -> KV store -> decode).

What lm-evaluation-harness's ``local-completions`` sends to score loglikelihood:
``completions.create(prompt=[ids], echo=True, logprobs=1, max_tokens=0)``; the answer's
``token_logprobs`` (first ``None``) must equal transformers' float32 log-softmax of the
prompt within 1e-4, also when the prompt's prefix was cached by an earlier request
(recomputed: ``cached_tokens`` 0). Also: echo with generated tokens after the prompt,
the streamed form, and vLLM's ``prompt_logprobs`` field on completions and chat.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import openai
import pytest
import torch
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import EngineService, KVStoreNode, tiny_model_dir  # noqa: E402

MAX_MODEL_LEN = 256
TOL = 1e-4
#: flags of every engine here: 32-token steps chunk the prompts
ENGINE_ARGS = ["--max-num-batched-tokens", "32", "--num-kv-blocks", "256", "--block-size",
               "16", "--max-model-len", str(MAX_MODEL_LEN)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(tiny_model_dir(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def _router(launcher: Launcher, tiny: str, *instances: str) -> openai.OpenAI:
    port = free_port()
    launcher.launch([Part("router", tandem_argv(
        "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
        "--model", tiny, "--max-model-len", str(MAX_MODEL_LEN), *instances),
        lambda: http_ok(f"http://127.0.0.1:{port}/ready"))], 300)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         timeout=120.0, max_retries=0)


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def client(request, tiny, tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp(request.param))
    services: list[EngineService | KVStoreNode] = []
    try:
        if request.param == "colocated":
            eng_port = free_port()
            launcher.launch([Part("engine", tandem_argv(
                "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model",
                tiny, "--dtype", "float32", *ENGINE_ARGS),
                lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
            instances = ("--colocated", f"127.0.0.1:{eng_port}")
        else:
            redis_url = request.getfixturevalue("redis_url")
            tmp = tmp_path_factory.mktemp("services")
            services.append(KVStoreNode(redis_url, tmp))
            for role in ("prefill", "decode"):
                services.append(EngineService(role, tiny, tmp, redis_url, ENGINE_ARGS))
            instances = ("--prefill", services[1].address, "--decode", services[2].address)
        yield _router(launcher, tiny, *instances)
    finally:
        launcher.close(timeout_s=30)
        for svc in reversed(services):
            svc.stop()


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def reference(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]`` float32 log-softmax predicting prompt tokens 1..n-1."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_token_logprobs(hf, ids: list[int], got: list[float | None]) -> None:
    ref = reference(hf, ids)
    assert got[0] is None
    assert len(got) == len(ids)
    for i in range(1, len(ids)):
        assert abs(got[i] - float(ref[i - 1, ids[i]])) < TOL, f"prompt token {i}"


def test_echo_max_tokens_0_is_the_prompts_logprobs(client, hf, tiny) -> None:
    from transformers import AutoTokenizer

    ids = prompt(1, 70)
    resp = client.completions.create(model=model_of(client), prompt=ids, echo=True,
                                     logprobs=1, max_tokens=0, temperature=0)
    choice = resp.choices[0]
    lps = choice.logprobs
    assert lps is not None and lps.token_logprobs is not None
    assert_token_logprobs(hf, ids, lps.token_logprobs)
    assert lps.top_logprobs[0] is None and len(lps.tokens) == len(ids)
    ref = reference(hf, ids)
    for i in range(1, len(ids)):  # the top-1 alternative is the argmax
        (value,) = lps.top_logprobs[i].values()
        assert abs(value - float(ref[i - 1].max())) < TOL
    assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)
    assert choice.text == AutoTokenizer.from_pretrained(tiny).decode(ids)
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == len(ids)


def test_cached_prefix_is_recomputed(client, hf) -> None:
    ids = prompt(2, 64)
    model = model_of(client)
    client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
    warm = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens >= 16  # the prefix is cached
    resp = client.completions.create(model=model, prompt=ids, echo=True, logprobs=1,
                                     max_tokens=0, temperature=0)
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert_token_logprobs(hf, ids, resp.choices[0].logprobs.token_logprobs)


def test_echo_then_generated_tokens(client, hf) -> None:
    ids = prompt(3, 20)
    resp = client.completions.create(model=model_of(client), prompt=ids, echo=True,
                                     logprobs=0, max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    lps = resp.choices[0].logprobs
    assert len(lps.token_logprobs) == len(ids) + 3
    assert_token_logprobs(hf, ids, lps.token_logprobs[: len(ids)])
    assert all(v is not None for v in lps.token_logprobs[len(ids):])
    assert resp.usage.completion_tokens == 3


def test_streamed_echo_matches_the_whole_answer(client, hf) -> None:
    ids = prompt(4, 40)
    chunks = list(client.completions.create(model=model_of(client), prompt=ids, echo=True,
                                            logprobs=1, max_tokens=0, temperature=0,
                                            stream=True))
    got: list[float | None] = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            got.extend(c.choices[0].logprobs.token_logprobs)
    assert_token_logprobs(hf, ids, got)


def test_vllm_prompt_logprobs_field(client, hf) -> None:
    ids = prompt(5, 30)
    resp = client.completions.create(model=model_of(client), prompt=ids, max_tokens=2,
                                     temperature=0, extra_body={"prompt_logprobs": 2})
    entries = resp.choices[0].model_extra["prompt_logprobs"]
    ref = reference(hf, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        own = entry[str(ids[i])]
        assert abs(own["logprob"] - float(ref[i - 1, ids[i]])) < TOL
        assert own["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        top2 = ref[i - 1].topk(2).indices.tolist()
        assert {str(t) for t in top2} <= set(entry)
        assert set(entry) <= {str(t) for t in top2} | {str(ids[i])}
    chat = client.chat.completions.create(
        model=model_of(client), messages=[{"role": "user", "content": "score me"}],
        max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])


def test_max_tokens_0_without_echo_is_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_of(client), prompt=[5, 6, 7], max_tokens=0)
    assert "max_tokens" in str(info.value)
