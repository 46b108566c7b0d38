"""Tenant fields through the real router with the official ``openai`` client: ``cache_salt``
(vLLM's) keeps prefix-cache hits within a salt, and ``priority`` on an FCFS engine is a 400
naming it (vLLM's behaviour). One colocated engine with the tiny random-weight Llama."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

MODEL = "h5_tiny_llama"  # the tiny model folder's name, which the router serves
MAX_MODEL_LEN = 256
# Longer than several 16-token blocks whatever the tokenizer makes of it.
PROMPT = "tenants keep their prefixes apart " * 8


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    tmp = tmp_path_factory.mktemp("tenants")
    eng_port, port = free_port(), free_port()
    launcher = Launcher(tmp)
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len",
            str(MAX_MODEL_LEN)), lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        launcher.launch([Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--model", tiny,
            "--colocated", f"127.0.0.1:{eng_port}", "--max-model-len", str(MAX_MODEL_LEN)),
            lambda: http_ok(f"http://127.0.0.1:{port}/ready"))], 300)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                            timeout=120.0, max_retries=0)
    finally:
        launcher.close(timeout_s=30)


def cached(client: openai.OpenAI, prompt: str, salt: str | None, chat: bool = False) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    if chat:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1,
            temperature=0, extra_body=extra)
    else:
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                         temperature=0, extra_body=extra)
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    return resp.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_cache_salt_separates_prefix_cache_hits(client, chat: bool) -> None:
    prompt = f"{PROMPT} ({'chat' if chat else 'completions'})"
    assert cached(client, prompt, "tenant-a", chat) == 0
    assert cached(client, prompt, "tenant-b", chat) == 0  # another salt shares nothing
    assert cached(client, prompt, None, chat) == 0  # nor does an unsalted request
    assert cached(client, prompt, "tenant-a", chat) >= 16  # the same salt: cached
    assert cached(client, prompt, None, chat) >= 16  # unsalted requests share as before


def test_empty_cache_salt_is_400_naming_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"cache_salt": ""})
    assert "cache_salt" in str(info.value)


def test_priority_on_an_fcfs_engine_is_400_naming_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                  extra_body={"priority": 3})
    assert "priority" in str(info.value)
    resp = client.completions.create(model=MODEL, prompt="hi", max_tokens=1,
                                     extra_body={"priority": 0})
    assert resp.choices[0].finish_reason == "length"
