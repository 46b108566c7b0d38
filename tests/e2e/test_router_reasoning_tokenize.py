"""``--reasoning-parser`` through every front door, and ``/tokenize`` / ``/detokenize``.

The engine serves a scripted tiny Llama: its layers add nothing to the residual stream
(zero output projections), so each next token depends on the last token alone, and its
embeddings and untied LM head are set so that greedy decoding of any chat prompt emits
``SCRIPT`` then EOS (a bigram chain over tokens that each occur once in it). The output
is thus known without any constraint, as a DeepSeek-R1 answer: thinking, ``</think>``
(one token, added to the tokenizer as reasoning models have it), answer. The router runs
``--reasoning-parser deepseek_r1``, so a structured output applies after ``</think>``.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from ports import free_port

from tandem.launch import Launcher, Part, grpc_serving, http_ok, tandem_argv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from services_harness import tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "scripted_think"
THINKING, ANSWER = "Let me see", "Yes, blue."
SCRIPT = f"{THINKING}</think>{ANSWER}"
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]


def make_scripted_model(folder: Path, tokenizer_from: Path) -> None:
    """A tiny Llama whose greedy output for any prompt not ending in a ``SCRIPT`` token
    is ``SCRIPT`` then EOS (see the module docstring)."""
    import torch
    from tiny_models import tiny_config, tiny_hf_model
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name not in ("model.safetensors", "config.json", "generation_config.json"):
            shutil.copy(f, folder / f.name)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["</think>"])  # the router requires it as one token (reasoning models')
    tok.save_pretrained(folder)
    chain = tok.encode(SCRIPT, add_special_tokens=False)
    assert len(set(chain)) == len(chain) and tok.decode(chain) == SCRIPT, chain
    hidden = 64
    assert len(chain) + 1 <= hidden
    config = tiny_config("LlamaForCausalLM", vocab=len(tok), hidden=hidden, ffn=128,
                         max_len=1024, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    model = tiny_hf_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, 0] = 1.0  # every other token: dimension 0, whose successor is chain[0]
        head[chain[0], 0] = 4.0
        for i, t in enumerate(chain):
            embed[t] = 0.0
            embed[t, i + 1] = 1.0
            nxt = chain[i + 1] if i + 1 < len(chain) else config.eos_token_id
            head[nxt, i + 1] = 4.0
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """(base URL, openai client, anthropic client) of a router with
    ``--reasoning-parser deepseek_r1`` over the scripted engine."""
    base = tmp_path_factory.getbasetemp()
    folder = tmp_path_factory.mktemp("scripted") / MODEL
    make_scripted_model(folder, tiny_model_dir(base))
    launcher = Launcher(tmp_path_factory.mktemp("reasoning"))
    eng_port, port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        launcher.launch([Part("engine", tandem_argv(
            "serve", "--role", "both", "--listen", f"127.0.0.1:{eng_port}", "--model",
            str(folder), "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len",
            "256"), lambda: grpc_serving(f"127.0.0.1:{eng_port}"))], 300)
        part = Part("router", tandem_argv(
            "router", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
            "--model", str(folder), "--colocated", f"127.0.0.1:{eng_port}",
            "--reasoning-parser", "deepseek_r1"), lambda: http_ok(f"{url}/ready"))
        launcher.launch([part], 300)
        yield (url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                  timeout=120),
               anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120))
        assert part.proc is not None
        part.proc.send_signal(signal.SIGTERM)
        assert part.proc.wait(timeout=30) == 0
    finally:
        launcher.close(timeout_s=30)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- reasoning ---------------------------------------------------------------------------------


def test_chat_splits_thinking_and_answer(router) -> None:
    _, client, _ = router
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                         temperature=0)
    msg = out.choices[0].message
    assert msg.content == ANSWER
    assert msg.model_extra["reasoning_content"] == THINKING
    assert out.choices[0].finish_reason == "stop"


def test_chat_stream_splits_thinking_and_answer(router) -> None:
    _, client, _ = router
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=32,
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (THINKING, ANSWER)
    # no delta carries a piece of the tag
    assert not any("<" in (d.content or "") or "</" in ((d.model_extra or {}).get(
        "reasoning_content") or "") for d in deltas)


def test_cut_thinking_is_all_reasoning(router) -> None:
    _, client, _ = router
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                         temperature=0)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert msg.content is None
    assert msg.model_extra["reasoning_content"] == THINKING


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_applies_to_the_answer_after_the_thinking(router, stream) -> None:
    """The thinking is the scripted free text (a grammar from the first token would
    forbid it); the answer, which the model would write as ``ANSWER``, is valid JSON."""
    _, client, _ = router
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "r", "schema": SCHEMA}})
    if stream:
        deltas = [c.choices[0].delta
                  for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        out = client.chat.completions.create(**kw)
        assert out.choices[0].finish_reason == "stop"
        reasoning = out.choices[0].message.model_extra["reasoning_content"]
        content = out.choices[0].message.content
    assert reasoning == THINKING
    assert isinstance(json.loads(content)["ok"], bool), content
    assert ANSWER not in content


def test_responses_reasoning_item(router) -> None:
    _, client, _ = router
    kw = dict(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=32, temperature=0)
    resp = client.responses.create(**kw)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == THINKING
    assert resp.output_text == ANSWER
    events = list(client.responses.create(stream=True, **kw))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, text) == (THINKING, ANSWER)
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THINKING


def test_messages_thinking_block(router) -> None:
    _, _, client = router
    greedy = {"temperature": 0}
    msg = client.messages.create(model=MODEL, max_tokens=32, messages=MESSAGES,
                                 extra_body=greedy)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert (msg.content[0].thinking, msg.content[1].text) == (THINKING, ANSWER)
    with client.messages.stream(model=MODEL, max_tokens=32, messages=MESSAGES,
                                extra_body=greedy) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (THINKING, ANSWER)


# -- /tokenize, /detokenize --------------------------------------------------------------------


def test_tokenize_prompt_round_trip(router) -> None:
    url, _, _ = router
    status, body = post(f"{url}/tokenize", {"model": MODEL, "prompt": "Hello world",
                                            "return_token_strs": True})
    assert status == 200
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
    assert body["max_model_len"] == 256
    status, plain = post(f"{url}/tokenize", {"prompt": "Hello world",
                                             "add_special_tokens": False})
    assert status == 200 and plain["token_strs"] is None
    status, back = post(f"{url}/detokenize", {"model": MODEL, "tokens": plain["tokens"]})
    assert (status, back) == (200, {"prompt": "Hello world"})


def test_tokenize_messages_counts_as_chat_usage(router) -> None:
    url, client, _ = router
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    status, body = post(f"{url}/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert status == 200 and body["count"] == out.usage.prompt_tokens
    status, no_prompt = post(f"{url}/tokenize", {"messages": MESSAGES,
                                                 "add_generation_prompt": False})
    assert status == 200 and no_prompt["count"] < body["count"]
    assert no_prompt["tokens"] == body["tokens"][:no_prompt["count"]]


@pytest.mark.parametrize(("path", "body", "param", "status"), [
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens", 400),
    ("/detokenize", {"tokens": [-1]}, "tokens", 400),
    ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ("/tokenize", {"prompt": "x", "mm_processor_kwargs": {}}, "mm_processor_kwargs", 400),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens",
     400),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model", 404),
])
def test_tokenize_errors_name_the_field(router, path, body, param, status) -> None:
    url, _, _ = router
    got, err = post(f"{url}{path}", body)
    assert got == status, err
    if param is not None:
        assert err["error"]["param"] == param
