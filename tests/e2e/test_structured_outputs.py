"""Structured outputs and tool calling on the real default model, on every path.

One module, each part started once: the offline ``LLM`` (the oracle, float32), `tandem up`'s
disaggregated stack (1 prefill + 1 decode + KV store + router, prefix caching on) driven
by the official ``openai`` client, and one colocated engine (``tandem serve --role
both``) driven over gRPC. Oracles: ``json.loads`` + ``jsonschema.validate``,
``re.fullmatch``, membership; greedy constrained output identical offline, colocated and
disaggregated.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from tandem.contracts.proto import sampling_params_to_proto
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sampling_params import StructuredOutputsParams as SO
from tandem.services.decode.client import DecodeCall
from tandem.up import Stack, StackConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from ports import free_port  # noqa: E402
from services_harness import EngineService, run_colocated  # noqa: E402
from waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48
ENGINE_ARGS = ["--dtype", "float32", "--kv-cache-memory", str(128 << 20), "--max-model-len", "1024"]
QUESTIONS = [
    "Describe a person as JSON.",
    "What is the capital of France?",
    "Is the sea salty? Explain briefly.",
    "Pick a city and tell me about it.",
    "How many legs does a spider have?",
]
SEEDS = [None, 3, 6, 16]  # None: greedy
# NOTE: any JSON object lets a 135M model ramble inside a string past any small max_tokens;
# these prompts end their object within MAX_TOKENS for every seed above (seen with the
# sampler's race noise from Philox4x32-10 keyed by (seed, output position),
# engine/categorical.py: another noise source picks other tokens for the same seed; the
# outputs are deterministic: greedy, or seeded draws keyed by (seed, output position)).
OBJECT_QUESTIONS = [
    "Reply with a JSON object: is water wet?",
    "Give me a JSON object with the key city.",
    "Give me a JSON object with the key animal.",
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes_tea": {"type": "boolean"},
    },
    "required": ["name", "age", "likes_tea"],
    "additionalProperties": False,
}
REGEX = r"(Yes|No), because [a-z ]{3,16}\."
CHOICES = ["Paris", "London", "Berlin", "Madrid"]
GRAMMAR = 'root ::= "The answer is " num "."\nnum ::= [0-9] | [1-9] [0-9]'


def _check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


def _check_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def _check_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def _check_choice(text: str) -> None:
    assert text in CHOICES, text


def _check_grammar(text: str) -> None:
    assert re.fullmatch(r"The answer is ([0-9]|[1-9][0-9])\.", text), text


# kind -> (constraint, HTTP extra body, oracle)
KINDS = {
    "json": (
        SO(json=PERSON, disable_any_whitespace=True),
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            "structured_outputs": {"disable_any_whitespace": True},
        },
        _check_json,
    ),
    "json_object": (
        SO(json_object=True, disable_any_whitespace=True),
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
        _check_object,
    ),
    "regex": (SO(regex=REGEX), {"guided_regex": REGEX}, _check_regex),
    "choice": (SO(choice=CHOICES), {"guided_choice": CHOICES}, _check_choice),
    "grammar": (SO(grammar=GRAMMAR), {"structured_outputs": {"grammar": GRAMMAR}}, _check_grammar),
}


def _chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def _runs(seeds: list[int | None] = SEEDS) -> list[tuple[str, str, int | None]]:
    """(kind, question, seed) of every constrained generation: 20 per kind with
    ``SEEDS``."""
    return [
        (k, q, s)
        for k in KINDS
        for q in (OBJECT_QUESTIONS if k == "json_object" else QUESTIONS)
        for s in seeds
    ]


def _params(kind: str, seed: int | None, **kw: object) -> SamplingParams:
    sampled = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=KINDS[kind][0], **{**sampled, **kw})


def _body(kind: str) -> dict:
    # NOTE: json's structured_outputs holds only disable_any_whitespace: no second kind.
    return dict(KINDS[kind][1])


@pytest.fixture(scope="module")
def offline():
    """Every kind x question x seed through the offline LLM (the oracle), and the model's
    tokenizer; the LLM is freed afterwards."""
    from tandem.engine.llm import LLM

    llm = LLM(dtype="float32", kv_cache_memory=96 << 20, max_model_len=1024)
    runs = _runs()
    outs = llm.chat(
        [_chat(q) for _, q, _ in runs], [_params(k, s) for k, _, s in runs], use_tqdm=False
    )
    results = {run: o.outputs[0] for run, o in zip(runs, outs, strict=True)}
    # Logprobs of a choice: every returned token must be one the grammar allows.
    lp = llm.chat(_chat(QUESTIONS[1]), _params("choice", 5, logprobs=5), use_tqdm=False)
    # Forced preemption: a cache of 12 blocks (192 tokens) for 8 growing sequences.
    small = LLM(dtype="float32", max_model_len=1024, kv_cache_memory=12 * 16 * 46080)
    pre = small.chat(
        [_chat(q) for q in QUESTIONS[:4]] * 2,
        [_params("json", None), _params("regex", None)] * 4,
        use_tqdm=False,
    )
    preempted = small.llm_engine.engine_core.scheduler.num_preemptions
    n3 = llm.chat(_chat(QUESTIONS[0]), _params("json", 7, n=3), use_tqdm=False)
    tok = llm.get_tokenizer()
    del llm, small
    return {
        "results": results,
        "logprobs": lp[0].outputs[0],
        "tokenizer": tok,
        "preempted": (preempted, [o.outputs[0] for o in pre]),
        "n3": n3[0].outputs,
    }


@pytest.fixture(scope="module")
def stack(redis_url, offline):
    cfg = StackConfig(
        num_prefill=1,
        num_decode=1,
        port=0,
        grpc_port=0,
        redis_url=redis_url,
        engine_args=ENGINE_ARGS,
        router_args=["--max-model-len", "1024"],
        startup_timeout_s=600,
    )
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(
        base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=300
    )


@pytest.fixture(scope="module")
def colocated(offline, tmp_path_factory):
    svc = EngineService(
        "both", None, tmp_path_factory.mktemp("colocated"), None, ENGINE_ARGS[2:], 600
    )
    yield svc
    svc.stop()


def test_offline_every_kind_greedy_and_sampled_obeys(offline) -> None:
    for (kind, q, seed), out in offline["results"].items():
        assert out.finish_reason == "stop", (kind, q, seed, out.text)
        KINDS[kind][2](out.text)


def test_offline_logprobs_see_only_allowed_tokens(offline) -> None:
    tok = offline["tokenizer"]
    out = offline["logprobs"]
    _check_choice(out.text)
    prefix = ""
    for token, pos in zip(out.token_ids, out.logprobs, strict=True):
        for tid, lp in pos.items():
            piece = tok.decode([tid])
            assert lp.logprob > float("-inf")
            assert tid == tok.eos_token_id or any(c.startswith(prefix + piece) for c in CHOICES), (
                prefix,
                piece,
            )
        prefix += tok.decode([token]) if token != tok.eos_token_id else ""


def test_offline_preemption_keeps_grammar_state(offline) -> None:
    preempted, outs = offline["preempted"]
    assert preempted > 0
    results = offline["results"]
    for i, out in enumerate(outs):
        kind = "json" if i % 2 == 0 else "regex"
        assert out.token_ids == results[(kind, QUESTIONS[i % 4], None)].token_ids, i


def test_offline_n3(offline) -> None:
    outs = offline["n3"]
    assert len(outs) == 3
    for out in outs:
        _check_json(out.text)


def _http(client, kind: str, q: str, seed: int | None, **kw: object):
    sampled = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}
    body = _body(kind)
    extra = {k: v for k, v in body.items() if k != "response_format"}
    return client.chat.completions.create(
        model=MODEL,
        messages=_chat(q),
        max_tokens=MAX_TOKENS,
        response_format=body.get("response_format", openai.NOT_GIVEN),
        extra_body=extra or None,
        **sampled,
        **kw,
    )


def test_disaggregated_every_kind_matches_offline(client, offline) -> None:
    """Prefill samples token 1 under the grammar; decode compiles it, replays token 1 and
    continues: the same tokens as offline, greedy and seeded."""
    results = offline["results"]
    runs = _runs()
    with ThreadPoolExecutor(16) as pool:  # concurrent, as clients are
        answers = list(pool.map(lambda run: _http(client, *run), runs))
    for run, r in zip(runs, answers, strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", run
        KINDS[run[0]][2](choice.message.content)
        assert choice.message.content == results[run].text, run


def _greedy_on(svc: EngineService, offline: dict, run: tuple[str, str, int | None]) -> list[int]:
    """The greedy tokens of ``run``'s chat prompt and constraint from a colocated service."""
    tok = offline["tokenizer"]
    text = tok.apply_chat_template(_chat(run[1]), tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    return run_colocated(svc, ids, sampling_params_to_proto(_params(run[0], None)))


def test_colocated_greedy_matches_offline(colocated, offline) -> None:
    runs = _runs([None])
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda run: _greedy_on(colocated, offline, run), runs))
    for run, ids in zip(runs, got, strict=True):
        assert ids == offline["results"][run].token_ids, run


@pytest.fixture(scope="module")
def small_colocated(offline, tmp_path_factory):
    """A colocated engine whose KV cache (12 blocks, as the offline preemption case's) cannot
    hold 8 growing sequences at once, its Prometheus metrics on a port: ``(service, port)``."""
    port = free_port()
    args = ["--kv-cache-memory", str(12 * 16 * 46080), "--max-model-len", "1024",
            "--metrics-port", str(port)]
    svc = EngineService("both", None, tmp_path_factory.mktemp("small"), None, args, 600)
    yield svc, port
    svc.stop()


def test_service_preemption_keeps_grammar_state(small_colocated, offline) -> None:
    """Constrained requests preempted inside a service (their KV freed and recomputed, the
    matcher kept) give the offline greedy tokens."""
    svc, port = small_colocated
    runs = [("json" if i % 2 == 0 else "regex", QUESTIONS[i % 4], None) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda run: _greedy_on(svc, offline, run), runs))
    for run, ids in zip(runs, got, strict=True):
        assert ids == offline["results"][run].token_ids, run

    def preemptions() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            m = re.search(r'^tandem:num_preemptions_total\{role="both"\} (\S+)$',
                          r.read().decode(), re.M)
        return float(m.group(1)) if m else 0.0

    wait_until(lambda: preemptions() > 0, 30, "a preemption in the service's metrics")


def test_n3_streamed_and_logprobs_over_http(client) -> None:
    r = _http(client, "json", QUESTIONS[0], 11, n=3)
    assert len(r.choices) == 3
    for c in r.choices:
        _check_json(c.message.content)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=_chat(QUESTIONS[1]),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_choice": CHOICES},
    )
    text, tops = "", []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].logprobs:
            tops += [t.token for lp in chunk.choices[0].logprobs.content for t in lp.top_logprobs]
    _check_choice(text)
    assert tops and all(
        any(c.startswith(t) or t in c for c in CHOICES) or t == "<|im_end|>" for t in tops
    ), tops


BAD = [
    ({"extra_body": {"guided_regex": "(["}}, "guided_regex", "Unclosed"),
    ({"extra_body": {"guided_json": {"type": 5}}}, "guided_json", "not a valid JSON schema"),
    ({"extra_body": {"guided_json": '{"$ref": "#/$defs/x"}'}}, "guided_json", "Cannot find"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "must not be empty"),
    (
        {"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}},
        "structured_outputs.grammar",
        "EBNF parser error",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
                },
            }
        },
        "response_format.json_schema.schema",
        "'not' at #/properties/a",
    ),
    (
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
        "response_format",
        "guided_regex",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            ]
        },
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "'g'",
    ),
]


@pytest.mark.parametrize(("kw", "param", "match"), BAD)
def test_bad_inputs_are_400s_and_the_next_request_succeeds(client, kw, param, match) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_chat("hi"), max_tokens=4, **kw)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    assert match in err["message"], err
    r = _http(client, "choice", QUESTIONS[1], None)
    _check_choice(r.choices[0].message.content)


# -- tool calling ------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = _chat("What is the weather in Paris?")


def _check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_parse_and_validate(client, tool_choice) -> None:
    only = None if tool_choice == "required" else "get_weather"
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
              temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, only)
    with client.chat.completions.stream(**kw) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    _check_calls(streamed.message.tool_calls, only)
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


def test_multi_turn_with_a_tool_result(client) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
        {
            "role": "tool",
            "tool_call_id": calls[0].id,
            "content": json.dumps({"temperature": 21, "unit": "celsius"}),
        },
    ]
    r2 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    c2 = r2.choices[0]
    assert c2.finish_reason in ("stop", "length", "tool_calls")
    assert c2.message.content or c2.message.tool_calls
    if c2.message.tool_calls:
        _check_calls(c2.message.tool_calls)


@pytest.mark.parametrize("seed", [None, 3])
def test_auto_is_well_formed_either_way(client, seed) -> None:
    sampled = {"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed}
    for stream in (False, True):
        kw = dict(
            model=MODEL,
            messages=_chat("Add 2 and 3 using the add tool."),
            tools=TOOLS,
            tool_choice="auto",
            max_tokens=60,
            **sampled,
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            calls: dict[int, dict] = {}
            content = ""
            finish = None
            for ch in chunks:
                if not ch.choices:
                    continue
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += (tc.function.name or "") if tc.function else ""
                    entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
                finish = ch.choices[0].finish_reason or finish
            assert content or calls
            for entry in calls.values():
                jsonschema.validate(
                    json.loads(entry["arguments"]), SCHEMAS[entry["name"]]
                ) if entry["name"] in SCHEMAS else json.loads(entry["arguments"])
            assert (finish == "tool_calls") == bool(calls) or finish == "length"
        else:
            c = client.chat.completions.create(**kw).choices[0]
            assert c.message.content or c.message.tool_calls
            for call in c.message.tool_calls or []:
                json.loads(call.function.arguments)
            assert (c.finish_reason == "tool_calls") == bool(
                c.message.tool_calls
            ) or c.finish_reason == "length"


def test_decode_replays_the_first_token_and_rejects_a_foreign_one(colocated, offline) -> None:
    """The decode side of the handoff (a Decode with ``first_token_id``, as after Prefill):
    a first token the grammar allows is replayed and continued; one it forbids fails the
    request with INVALID_ARGUMENT naming ``first_token_id``, never unconstrained text."""
    import grpc

    from tandem.v1 import decode_pb2

    tok = offline["tokenizer"]
    text = tok.apply_chat_template(_chat(QUESTIONS[1]), tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    want = offline["results"][("choice", QUESTIONS[1], None)].token_ids
    sp = sampling_params_to_proto(_params("choice", None))
    good = decode_pb2.DecodeRequest(
        prompt_token_ids=ids, first_token_id=want[0], sampling_params=sp
    )
    got = [want[0]] + [t for m in DecodeCall(colocated.decode, good, timeout=120) for t in m.token_ids]
    assert got == want
    foreign = tok.encode(" banana", add_special_tokens=False)[0]
    bad = decode_pb2.DecodeRequest(prompt_token_ids=ids, first_token_id=foreign, sampling_params=sp)
    with pytest.raises(grpc.RpcError) as info:
        list(DecodeCall(colocated.decode, bad, timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first_token_id" in info.value.details()
    assert ("tandem-field", "first_token_id") in tuple(info.value.trailing_metadata())


def test_completions_and_public_grpc_take_constraints(stack, client, offline) -> None:
    """The other front doors: ``/v1/completions`` (vLLM's fields there too) and the public
    ``GenerationService.Generate`` (the ``StructuredOutputs`` oneof in its sampling
    params), the latter matching offline greedy output token for token."""
    import grpc

    from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_choice": CHOICES},
    )
    assert r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop"
    q = QUESTIONS[1]
    want = offline["results"][("regex", q, None)]
    sp = sampling_params_to_proto(_params("regex", None))
    with grpc.insecure_channel(stack.grpc_address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        req = generation_pb2.GenerateRequest(
            chat=generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content=q)]
            ),
            sampling_params=sp,
        )
        msgs = list(stub.Generate(req, timeout=300))
        assert [t for m in msgs for t in m.token_ids] == want.token_ids
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        bad = common_pb2.SamplingParams(max_tokens=4)
        bad.structured_outputs.regex = "(["
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.Generate(
                    generation_pb2.GenerateRequest(text="hi", sampling_params=bad), timeout=300
                )
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in info.value.details()
