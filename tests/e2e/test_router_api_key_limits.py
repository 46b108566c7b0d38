"""Per-API-key limits (``--api-keys``) through two real routers sharing one Redis, with the
official ``openai`` and ``anthropic`` clients (no retries): a key over its requests or
tokens per minute gets a 429 with ``Retry-After`` while other keys do not, the second
replica refuses what the first used up, every door applies them, and ``/metrics`` counts
them per tenant. One colocated engine with the tiny random-weight Llama.

Each test uses its own tenants, and all of a test's requests fall well within one minute.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

MODEL = "h5_tiny_llama"
MAX_MODEL_LEN = 256
TOKENS_PER_MINUTE = 100
KEYS = f"""
sk-rpm: {{tenant: rpm, requests_per_minute: 2}}
sk-tpm: {{tenant: tpm, tokens_per_minute: {TOKENS_PER_MINUTE}}}
sk-free: {{tenant: free}}
sk-shared: {{tenant: shared, requests_per_minute: 3}}
sk-doors-1: {{tenant: doors, requests_per_minute: 2}}
sk-doors-2: {{tenant: doors, requests_per_minute: 2}}
"""


@pytest.fixture(scope="module")
def routers(tmp_path_factory, redis_url):
    """The two routers' base URLs."""
    tiny = str(tiny_model_dir(tmp_path_factory.getbasetemp()))
    tmp = tmp_path_factory.mktemp("api_key_limits")
    keys = tmp / "keys.yaml"
    keys.write_text(KEYS)
    eng_port, ports = free_port(), [free_port(), free_port()]
    launcher = Launcher(tmp)
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model", tiny,
            "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len",
            str(MAX_MODEL_LEN)), lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        launcher.launch([Part(f"router{i}", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--model", tiny, "--colocated", f"127.0.0.1:{eng_port}", "--max-model-len",
            str(MAX_MODEL_LEN), "--api-keys", str(keys), "--rate-limit-url", redis_url),
            lambda port=port: http_ok(f"http://127.0.0.1:{port}/ready"))
            for i, port in enumerate(ports)], 300)
        yield [f"http://127.0.0.1:{port}" for port in ports]
    finally:
        launcher.close(timeout_s=30)


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=120.0, max_retries=0)


def complete(c: openai.OpenAI, max_tokens: int = 1) -> openai.types.Completion:
    return c.completions.create(model=MODEL, prompt="hi", max_tokens=max_tokens,
                                temperature=0)


def metrics(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as resp:
        return resp.read().decode()


def test_requests_per_minute_refuse_one_key_not_another(routers) -> None:
    rpm, free = client(routers[0], "sk-rpm"), client(routers[0], "sk-free")
    complete(rpm)
    complete(rpm)
    with pytest.raises(openai.RateLimitError) as info:
        complete(rpm)
    retry_after = int(info.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "rate_limit_exceeded"
    assert "2 requests per minute" in body["message"]
    for _ in range(3):
        complete(free)  # no limits
    text = metrics(routers[0])
    assert 'tandem:router_rate_limited_total{limit="requests_per_minute",tenant="rpm"} 1.0' \
        in text
    assert 'tandem:router_tenant_requests_total{tenant="rpm"} 2.0' in text
    assert 'tandem:router_tenant_requests_total{tenant="free"} 3.0' in text
    with pytest.raises(openai.AuthenticationError):
        complete(client(routers[0], "sk-unknown"))


def test_tokens_per_minute_count_prompt_plus_max_tokens_then_the_actual_use(routers) -> None:
    tpm = client(routers[0], "sk-tpm")
    first = complete(tpm, max_tokens=30)
    assert first.usage is not None
    used, prompt = first.usage.total_tokens, first.usage.prompt_tokens
    # the window holds what the first request used (its reservation corrected to it)
    room = TOKENS_PER_MINUTE - used - prompt
    with pytest.raises(openai.RateLimitError) as info:
        complete(tpm, max_tokens=room + 1)  # one token more than the window has
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 60
    assert "tokens per minute" in str(info.value)
    complete(client(routers[0], "sk-free"), max_tokens=room + 1)  # other keys: no limit
    second = complete(tpm, max_tokens=room)  # exactly fits
    with pytest.raises(openai.RateLimitError) as info:
        complete(tpm, max_tokens=TOKENS_PER_MINUTE)  # larger than the whole limit
    assert "retry-after" not in info.value.response.headers
    assert "Request too large" in str(info.value)
    assert second.usage is not None
    text = metrics(routers[0])
    assert 'tandem:router_rate_limited_total{limit="tokens_per_minute",tenant="tpm"} 2.0' \
        in text
    assert (f'tandem:router_tenant_tokens_total{{tenant="tpm"}} '
            f'{float(used + second.usage.total_tokens)}') in text


def test_replicas_sharing_one_redis_share_the_limit(routers) -> None:
    one, two = client(routers[0], "sk-shared"), client(routers[1], "sk-shared")
    for _ in range(3):
        complete(one)
    with pytest.raises(openai.RateLimitError):
        complete(two)  # the first replica used up the tenant's three
    complete(client(routers[1], "sk-free"))
    assert ('tandem:router_rate_limited_total{limit="requests_per_minute",tenant="shared"} '
            '1.0') in metrics(routers[1])


def test_responses_and_messages_doors_apply_the_tenants_limits(routers) -> None:
    """Two keys of one tenant share its limit across ``/v1/responses`` and
    ``/v1/messages``; the Messages API answers in Anthropic's error shape."""
    responses = client(routers[0], "sk-doors-1")
    messages = anthropic.Anthropic(base_url=routers[1], api_key="sk-doors-2",
                                   max_retries=0, timeout=120.0)
    responses.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    messages.messages.create(model=MODEL, max_tokens=1,
                             messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.RateLimitError) as info:
        messages.messages.create(model=MODEL, max_tokens=1,
                                 messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert int(info.value.response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        responses.responses.create(model=MODEL, input="hi", max_output_tokens=1, stream=True)
    with pytest.raises(openai.RateLimitError):
        client(routers[0], "sk-doors-2").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            stream=True)
