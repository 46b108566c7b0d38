"""The OpenAI API end to end: `tandem up`'s disaggregated stack with the real default model.

One stack per module (redis from the ``redis_url`` fixture, a KV store node, 1 prefill,
1 decode, the router; float32) driven by the official ``openai`` client. The oracle is
the offline ``LLM`` on the same model in float32: greedy text must match exactly, streamed
or not, through chat and completions, over HTTP and gRPC.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest
from waiting import wait_until

from tandem.engine.sampling_params import SamplingParams
from tandem.up import Stack, StackConfig
from tandem.v1 import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about tea."]
PROMPTS = ["The quick brown fox", "Once upon a time, in a small village,"]
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", str(192 << 20),
               "--max-model-len", "2048"]


def _chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


FOLLOW_UP = "Now one about coffee, please."


def _turn2(q: str, answer: str) -> list[dict]:
    return [*_chat(q), {"role": "assistant", "content": answer},
            {"role": "user", "content": FOLLOW_UP}]


@pytest.fixture(scope="module")
def oracle():
    """Greedy outputs of the offline LLM (float32), computed once; the model is freed after."""
    from tandem.engine.llm import LLM

    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=2048)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    chat = {q: o.outputs[0] for q, o in zip(
        QUESTIONS, llm.chat([_chat(q) for q in QUESTIONS], greedy, use_tqdm=False), strict=True)}
    comp = {p: o.outputs[0] for p, o in zip(
        PROMPTS, llm.generate(PROMPTS, greedy, use_tqdm=False), strict=True)}
    q = QUESTIONS[2]  # its answer spans blocks beyond the prompt's
    turn2 = llm.chat([_turn2(q, chat[q].text)], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    del llm
    return {"chat": chat, "completion": comp, "tokenizer": tok, "turn2": turn2}


@pytest.fixture(scope="module")
def stack(redis_url, oracle):
    cfg = StackConfig(num_prefill=1, num_decode=1, port=0, grpc_port=0, redis_url=redis_url,
                      engine_args=ENGINE_ARGS, router_args=["--max-model-len", "2048"],
                      startup_timeout_s=600)
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0,
                         timeout=300)


@pytest.fixture
def aclient(stack):
    return openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0,
                              timeout=300)


def test_chat_greedy_matches_offline_llm(client, oracle) -> None:
    for q in QUESTIONS:
        want = oracle["chat"][q]
        resp = client.chat.completions.create(model=MODEL, messages=_chat(q),
                                              max_tokens=MAX_TOKENS, temperature=0)
        choice = resp.choices[0]
        assert choice.message.content == want.text, q
        assert choice.message.role == "assistant"
        assert choice.finish_reason == want.finish_reason
        assert resp.usage.completion_tokens == len(want.token_ids)
        ids = oracle["tokenizer"].apply_chat_template(_chat(q), tokenize=False,
                                                     add_generation_prompt=True)
        assert resp.usage.prompt_tokens == len(oracle["tokenizer"].encode(
            ids, add_special_tokens=False))
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + len(want.token_ids)


def test_chat_stream_matches_and_is_well_formed(client, oracle) -> None:
    q = QUESTIONS[0]
    want = oracle["chat"][q]
    stream = client.chat.completions.create(
        model=MODEL, messages=_chat(q), max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    # The role arrives together with the first token, never alone before it.
    assert content[0].choices[0].delta.role == "assistant"
    assert content[0].choices[0].delta.content
    assert all(c.choices[0].delta.role is None for c in content[1:])
    assert "".join(c.choices[0].delta.content or "" for c in content) == want.text
    assert [c.choices[0].finish_reason for c in content][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(want.token_ids)
    running = [c.usage.completion_tokens for c in content]  # continuous_usage_stats
    assert running == sorted(running) and running[-1] == len(want.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_completions_greedy_stream_and_not(client, oracle) -> None:
    for p in PROMPTS:
        want = oracle["completion"][p]
        resp = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                         temperature=0)
        assert resp.choices[0].text == want.text
        assert resp.usage.completion_tokens == len(want.token_ids)
        assert resp.usage.prompt_tokens == len(oracle["tokenizer"].encode(p))
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True))
        assert text == want.text


def test_token_id_prompts_and_batches(client, oracle) -> None:
    ids = oracle["tokenizer"].encode(PROMPTS[0])
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert resp.choices[0].text == oracle["completion"][PROMPTS[0]].text
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                     temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    texts = [c.text for c in resp.choices]
    assert texts == [oracle["completion"][p].text for p in PROMPTS for _ in range(2)]


def test_stop_string_cuts_text_and_cancels_decode(client, oracle) -> None:
    want = oracle["completion"][PROMPTS[1]].text
    words = want.split()
    assert len(words) > 4, want
    stop = words[3]
    cut = want[: want.index(stop)]
    for stream in (False, True):
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                         temperature=0, stop=[stop, "zzzz-never"],
                                         stream=stream)
        if stream:
            chunks = list(resp)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == cut, (stream, stop)
        assert finish == "stop"
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                     temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert resp.choices[0].text == cut + stop
    assert resp.choices[0].model_extra["stop_reason"] == stop


def test_stop_token_id_is_the_stop_reason_at_every_position(client, oracle) -> None:
    """A stop token id matched by the first token (sampled on the prefill instance) or by
    a later one (on the decode instance) ends the choice with it as ``stop_reason`` (the
    first token's was lost: PrefillResponse had no field for it)."""
    ids = oracle["completion"][PROMPTS[0]].token_ids
    for pos in (0, 3):
        assert ids[pos] not in ids[:pos], ids
        resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"stop_token_ids": [ids[pos]]})
        choice = resp.choices[0]
        assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", ids[pos])
        assert resp.usage.completion_tokens == pos + 1


@pytest.mark.parametrize("body", [
    '{"model": "m", "prompt": ' + "[" * 3000 + "]" * 3000 + "}",
    '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": '
    + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
], ids=["nested-prompt", "nested-object"])
def test_deeply_nested_body_is_a_400_and_the_connection_lives_on(stack, client, body) -> None:
    """JSON nested beyond what Python's decoder recurses into: a 400 in OpenAI's form (it
    was a 500 from a RecursionError, and the keep-alive connection was reset), then a
    normal request on the same connection succeeds."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    with httpx.Client(base_url=stack.http_url, timeout=60) as http:
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "nested too deeply" in resp.json()["error"]["message"]
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0],
                                                "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text


def test_n_choices_greedy_and_seeded(client, oracle) -> None:
    q = QUESTIONS[1]
    resp = client.chat.completions.create(model=MODEL, messages=_chat(q), n=3,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.message.content == oracle["chat"][q].text for c in resp.choices)
    assert resp.usage.completion_tokens == 3 * len(oracle["chat"][q].token_ids)
    kw = dict(model=MODEL, messages=_chat(q), n=2, max_tokens=12, temperature=1.0, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    by_index = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.delta.content or ""
    assert [by_index[0], by_index[1]] == [c.message.content for c in a.choices]


def test_max_tokens_one(client) -> None:
    for stream in (False, True):
        resp = client.chat.completions.create(model=MODEL, messages=_chat("Hi"), max_tokens=1,
                                              temperature=0, stream=stream,
                                              stream_options={"include_usage": True}
                                              if stream else None)
        if stream:
            chunks = list(resp)
            assert chunks[-1].usage.completion_tokens == 1
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        else:
            assert resp.usage.completion_tokens == 1
            assert resp.choices[0].finish_reason == "length"


def test_logprobs_chat_and_completions(client, oracle) -> None:
    q = QUESTIONS[0]
    resp = client.chat.completions.create(model=MODEL, messages=_chat(q), max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
        assert entry.token == entry.top_logprobs[0].token
    # Token texts spell the message (the EOS token's text, if it came, is not in it).
    assert "".join(e.token for e in content).startswith(resp.choices[0].message.content)
    comp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_prepends_prompt(client, oracle) -> None:
    p = PROMPTS[0]
    resp = client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                     temperature=0, echo=True)
    assert resp.choices[0].text == p + oracle["completion"][p].text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, echo=True, stream=True))
    assert text == p + oracle["completion"][p].text


def test_request_id_propagated_and_echoed(stack) -> None:
    resp = httpx.post(f"{stack.http_url}/v1/chat/completions",
                      json={"model": MODEL, "messages": _chat("Hi"), "max_tokens": 2},
                      headers={"X-Request-Id": "my-req-42"}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Request-Id"] == "my-req-42"
    assert resp.json()["id"] == "chatcmpl-my-req-42"
    timings = resp.json()["timings"]
    if not stack.config.colocated:
        assert timings["prefill_instance"] != timings["decode_instance"]
    # every token the Decode stream carried is accounted for (colocated: the first too)
    from_decode = resp.json()["usage"]["completion_tokens"] - (0 if stack.config.colocated
                                                              else 1)
    assert timings.get("decode_tokens", 0) == from_decode
    # per-token attribution lives in the request's trace, not in every answer
    assert not {"decode_grpc_ns", "decode_engine_ns", "decode_sse_ns"} & set(timings)


def test_grpc_generate_matches_http(stack, oracle) -> None:
    q = QUESTIONS[2]
    with grpc.insecure_channel(stack.grpc_address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        req = generation_pb2.GenerateRequest(
            request_id="grpc-1",
            chat=generation_pb2.ChatMessages(messages=[
                generation_pb2.ChatMessage(role="user", content=q)]),
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        msgs = list(stub.Generate(req, timeout=300))
        again = list(stub.Generate(req, timeout=300))
    # the second time, the prompt's full blocks (16 tokens each) are prefix-cached
    assert again[-1].usage.cached_tokens >= 16
    assert "".join(m.text for m in msgs) == oracle["chat"][q].text
    assert [t for m in msgs for t in m.token_ids] == oracle["chat"][q].token_ids
    assert all(m.request_id == "grpc-1" for m in msgs)
    last = msgs[-1]
    assert last.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert last.usage.completion_tokens == len(oracle["chat"][q].token_ids)
    assert last.timings.ttft_ns > 0 and last.timings.prefill_compute_ns > 0


def test_bad_request_amid_good_ones_disturbs_none(stack, oracle) -> None:
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="none",
                                      max_retries=0, timeout=300) as ac:
            async def good(i: int) -> str:
                q = QUESTIONS[i % len(QUESTIONS)]
                r = await ac.chat.completions.create(model=MODEL, messages=_chat(q),
                                                     max_tokens=MAX_TOKENS, temperature=0)
                return r.choices[0].message.content

            async def bad() -> int:
                try:
                    await ac.chat.completions.create(model=MODEL, messages=_chat("x"),
                                                     max_tokens=MAX_TOKENS, temperature=-1)
                except openai.BadRequestError as exc:
                    return exc.status_code
                return 200

            tasks = [good(i) for i in range(16)]
            tasks.insert(8, bad())
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert results[8] == 400
    goods = results[:8] + results[9:]
    assert goods == [oracle["chat"][QUESTIONS[i % len(QUESTIONS)]].text for i in range(16)]


def test_64_concurrent_streams_complete(stack) -> None:
    async def run() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{stack.http_url}/v1", api_key="none",
                                      max_retries=0, timeout=600) as ac:
            async def one(i: int) -> tuple[str, str | None]:
                stream = await ac.completions.create(
                    model=MODEL, prompt=f"Request {i}: count to ten.", max_tokens=8,
                    temperature=0, stream=True)
                text, finish = "", None
                async for c in stream:
                    text += c.choices[0].text
                    finish = c.choices[0].finish_reason or finish
                return text, finish

            return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(finish in ("stop", "length") for _, finish in results)
    assert all(text for text, _ in results)


def _decode_load(stack) -> common_pb2.GetLoadResponse:
    address = stack.part("colocated-0" if stack.config.colocated else "decode-0").url
    with grpc.insecure_channel(address) as ch:
        return decode_pb2_grpc.DecodeServiceStub(ch).GetLoad(common_pb2.GetLoadRequest(),
                                                             timeout=10)


def test_disconnect_mid_stream_frees_decode_blocks(stack) -> None:
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{stack.http_url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            # NOTE: next() on one iterator, not a `for ... break`: closing the iterator
            # would close the response (disconnect) before the check below.
            lines = resp.iter_lines()
            events = []
            while len(events) < 5:
                line = next(lines)
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
            assert all("error" not in e for e in events), events
            load = _decode_load(stack)
            assert load.num_running_requests + load.num_waiting_requests >= 1, events
        # Leaving the block closes the connection mid-stream.
    load = wait_until(lambda: (lambda r: r if r.num_running_requests == 0
                              and r.num_waiting_requests == 0
                              and r.num_free_blocks == r.num_total_blocks else None)(
        _decode_load(stack)), 60, "decode instance to free the request's blocks")
    assert load.num_total_blocks > 0


def test_metrics_exposed(stack) -> None:
    text = httpx.get(f"{stack.http_url}/metrics", timeout=30).text
    for name in ("tandem:router_time_to_first_token_seconds_bucket",
                 "tandem:router_inter_token_latency_seconds_bucket",
                 "tandem:router_e2e_request_latency_seconds_count",
                 "tandem:router_prompt_tokens_total", "tandem:router_generation_tokens_total",
                 "tandem:router_num_requests_running", "tandem:router_num_requests_waiting",
                 "tandem:router_instance_kv_cache_usage_perc",
                 "tandem:router_instance_prefix_cache_hit_rate"):
        assert name in text, name
    if not stack.config.colocated:
        assert "tandem:router_kv_handoff_seconds_count" in text
        assert "tandem:router_kv_handoff_bytes_total" in text


def test_chat_turn_2_reuses_turn_1_prompt_and_answer(client, oracle, redis_url) -> None:
    """Turn 2 of a chat (turn 1's messages, its answer, a new question): the prefill
    computes neither turn 1's prompt (its prefix cache) nor the answer (the decode
    published its blocks when turn 1 finished). The answer's text re-tokenises to the ids
    the model generated, so the hash chains meet; the output equals the offline LLM's.
    (With --kv-publish-output=false the wait for the answer's blocks times out.)"""
    import redis

    from tandem.contracts.block_hash import hash_token_blocks

    q, tok = QUESTIONS[2], oracle["tokenizer"]
    turn1 = oracle["chat"][q]
    resp = client.chat.completions.create(model=MODEL, messages=_chat(q),
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == turn1.text
    prompt1 = tok.encode(tok.apply_chat_template(_chat(q), tokenize=False,
                                                 add_generation_prompt=True),
                         add_special_tokens=False)
    # KV exists for every token but the last generated one; its full blocks are published.
    computed = list(prompt1) + list(turn1.token_ids)[:-1]
    last = hash_token_blocks(computed, 16)[-1]
    r = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: list(r.scan_iter(f"tandem:kv:blk:*:{last.hex()}")), 60,
                   "the decode's publish of turn 1's answer")
    finally:
        r.close()
    resp = client.chat.completions.create(model=MODEL, messages=_turn2(q, turn1.text),
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.content == oracle["turn2"].text
    cached = resp.model_extra["timings"]["cached_tokens"]
    assert resp.usage.prompt_tokens_details.cached_tokens == cached
    assert cached == len(computed) // 16 * 16
    assert cached > len(prompt1) // 16 * 16, "the answer's blocks must count too"


#: three full blocks and more, templated or not; asked about nowhere else in this module
LONG_PROMPT = ("A lighthouse keeper kept a logbook of every ship that passed the rocky "
               "point: the schooners in spring, the whalers in summer, the mail steamer "
               "each Thursday, and in winter only the gulls. One morning the log read:")


def test_usage_reports_cached_prompt_tokens(client) -> None:
    """``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field) is the count of
    prompt tokens the prefilling engine did not compute, as ``timings.cached_tokens``
    reports it: the second request with a prompt finds its full blocks in the prefill's
    prefix cache, through completions and chat, streamed or not, and with n > 1."""
    def check_stream(chunks: list) -> None:
        last = [c for c in chunks if c.choices][-1]
        cached = last.model_extra["timings"]["cached_tokens"]
        assert cached >= 32
        assert chunks[-1].choices == []
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    kw = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    first = client.completions.create(prompt=LONG_PROMPT, **kw)
    assert first.usage.prompt_tokens >= 48
    assert first.usage.prompt_tokens_details.cached_tokens == \
        first.model_extra["timings"]["cached_tokens"]
    resp = client.completions.create(prompt=LONG_PROMPT, **kw)
    assert resp.usage.prompt_tokens_details.cached_tokens == \
        resp.model_extra["timings"]["cached_tokens"] >= 32
    check_stream(list(client.completions.create(prompt=LONG_PROMPT, **kw, **stream)))
    # n > 1: the choices share the prompt, counted once (the first choice's)
    two = client.completions.create(prompt=LONG_PROMPT, n=2, **kw)
    assert two.usage.prompt_tokens == resp.usage.prompt_tokens
    assert two.usage.prompt_tokens_details.cached_tokens == \
        two.model_extra["timings"]["cached_tokens"] >= 32

    messages = _chat(LONG_PROMPT)
    client.chat.completions.create(messages=messages, **kw)
    resp = client.chat.completions.create(messages=messages, **kw)
    assert resp.usage.prompt_tokens_details.cached_tokens == \
        resp.model_extra["timings"]["cached_tokens"] >= 32
    check_stream(list(client.chat.completions.create(messages=messages, **kw, **stream)))


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_readme_client_examples_run_with_plain_python(stack, where, tmp_path) -> None:
    """The README's "Talk to it" examples (the openai SDK streaming a chat, the gRPC
    Generate stream), as a user runs them: plain ``python``, from the repository root and
    from another folder, against this stack's ports instead of the README's 8000 / 50051."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    blocks = re.findall(r"```python\n(.*?)```", (root / "README.md").read_text(), flags=re.S)
    clients = [b for b in blocks if "from openai import OpenAI" in b or "import grpc" in b]
    assert len(clients) == 2, "README: expected the openai and the gRPC example"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    for block in clients:
        code = (block.replace("http://127.0.0.1:8000/v1", f"{stack.http_url}/v1")
                .replace("127.0.0.1:50051", stack.grpc_address))
        proc = subprocess.run([sys.executable, "-c", code], cwd=root if where == "root"
                              else tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip(), "the example printed no answer"
