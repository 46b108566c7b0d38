"""Structured outputs in the engine on a tiny random model over a tiny text vocabulary.

The manager (compile cache, compiles off the step loop, abort while compiling, timeouts,
library errors naming the field), the sampler's bitmask (applied before every rule, the
logprobs included) and the scheduler (WAITING_FOR_GRAMMAR, grammar completion ->
"stop", preemption keeps the matcher right, replay of tokens a request came with).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading

import jsonschema
import pytest
import torch
from engine_steps import run
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.model_loader import LoadedModel
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sampling_params import StructuredOutputsParams as SO
from tandem.engine.structured_output.backend import XgrammarBackend, choice_grammar
from tandem.engine.structured_output.bitmask import apply_token_bitmask, apply_token_bitmask_ref
from tandem.engine.structured_output.manager import StructuredOutputManager
from tandem.engine.validation import GrammarCompilerBusyError, RequestError

# 96 text tokens and a stop token (id 96): what the tiny model's logits range over.
_CHARS = list('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]":, \n.-_')
_WORDS = ["true", "false", "null", '"a"', '"b"', "ab", "yes", "no", '{"', '":', "12", "34"]
VOCAB = _CHARS + _WORDS
VOCAB += [f"<unused{i}>" for i in range(96 - len(VOCAB))]
STOP = len(VOCAB)
VOCAB.append("</s>")
MAX_LEN = 96
BLOCK = 4
_ids = itertools.count()

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def text_of(ids: list[int]) -> str:
    return "".join(VOCAB[t] for t in ids if t != STOP)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    config = tiny_config(
        "LlamaForCausalLM",
        vocab=len(VOCAB),
        hidden=32,
        ffn=64,
        max_len=MAX_LEN,
        special_tokens=False,
    )
    return as_loaded_model(tiny_hf_model(config, std=0.3), "tiny-llama", MAX_LEN)


def backend(num_workers: int = 2) -> XgrammarBackend:
    return XgrammarBackend.from_vocab(VOCAB, STOP, num_workers)


@pytest.fixture(scope="module", autouse=True)
def shared_backend():
    # Held for the module: the engines made by the tests share its compile processes.
    b = backend()
    yield b
    b.shutdown()


#: A regex that xgrammar compiles for seconds over this vocabulary (each bounded repeat
#: costs ~0.4 s; 40 of them, far past the limits the tests set).
SLOW_REGEX = "".join(f"[a-z]{{1,{300 + i}}}-" for i in range(40))


def make_core(
    loaded: LoadedModel,
    manager: StructuredOutputManager | None = None,
    num_blocks: int = 64,
    speculative: SpeculativeConfig | None = None,
) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        speculative=speculative,
    )
    return EngineCore(
        config,
        create_executor(config, loaded),
        manager if manager is not None else StructuredOutputManager(backend),
    )


def make_request(so: SO | None, prompt: list[int] | None = None, **params: object) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 60)
    return Request(
        f"r{next(_ids)}", prompt or [1, 2, 3], SamplingParams(structured_outputs=so, **params)
    )


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def assert_idle(core: EngineCore) -> None:
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.has_unfinished_requests()
    assert not core.scheduler._waiting_for_grammar


# -- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field", "match"),
    [
        ({}, "structured_outputs", "must set one of"),
        ({"json": SCHEMA, "regex": "a"}, "structured_outputs.json", "json and regex"),
        ({"choice": []}, "structured_outputs.choice", "must not be empty"),
        ({"choice": ["a", 3]}, "structured_outputs.choice", "non-empty strings"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": [1]}, "structured_outputs.json", "JSON schema"),
        ({"regex": ""}, "structured_outputs.regex", "non-empty string"),
        ({"json": True}, "structured_outputs.json", "must be a JSON schema object"),
        ({"json": "true"}, "structured_outputs.json", "must be a JSON schema object"),
        ({"json": '{"type": []}'}, "structured_outputs.json", "not a valid JSON schema at #/type"),
        ({"json": {"type": 5}}, "structured_outputs.json", "not a valid JSON schema at #/type"),
        (
            {"json": {"properties": {"a": {"not": {"type": "string"}}}}},
            "structured_outputs.json",
            "'not' at #/properties/a",
        ),
        (
            {"json": {"allOf": [{"type": "integer"}, {"maximum": 3}]}},
            "structured_outputs.json",
            "'allOf' with 2",
        ),
        ({"json": {"$defs": {"x": {"if": {}}}}}, "structured_outputs.json", r"'if' at #/\$defs/x"),
        ({"regex": "a" * (128 * 1024 + 1)}, "structured_outputs.regex", "longer than 131072"),
        # The size cap comes first: the metaschema check of a huge schema stalled the router
        # for seconds before the refusal.
        ({"json": {"type": 5, "description": "x" * (128 * 1024)}}, "structured_outputs.json",
         "longer than 131072"),
        # An external reference: xgrammar only warns and leaves that part unconstrained.
        ({"json": {"$ref": "http://example.com/s.json"}}, "structured_outputs.json",
         r"'\$ref' to 'http://example\.com/s\.json'"),
        (
            {"json": {"properties": {"a": {"$ref": "other.json#/x"}}}},
            "structured_outputs.json",
            "at #/properties/a",
        ),
    ],
)
def test_params_shape_errors_name_the_field(kwargs, field, match) -> None:
    with pytest.raises(RequestError, match=match) as info:
        SO(**kwargs)
    assert info.value.field == field


def test_min_tokens_with_a_constraint_is_refused_naming_min_tokens() -> None:
    # It used to be accepted and then failed mid-generation once the grammar allowed only
    # EOS ("sampled token ... is not allowed"), after a streamed answer had begun.
    with pytest.raises(RequestError, match="min_tokens cannot be combined") as info:
        SamplingParams(min_tokens=2, structured_outputs=SO(json_object=True))
    assert info.value.field == "min_tokens"
    SamplingParams(min_tokens=2)  # without a constraint it is fine


def test_spec_and_cache_key_keep_the_schemas_key_order() -> None:
    """Bug: the spec was sorted JSON, so `reasoning` then `answer` compiled to a grammar
    that emits `answer` first; and a sorted cache key would hand one order's grammar to
    a request with the other order."""
    a = SO(json={"b": 1, "a": 2})
    b = SO(json='{"b": 1, "a": 2}')
    assert a.spec() == b.spec() == '{"b":1,"a":2}'
    assert a.cache_key() == b.cache_key() == ("json", '{"b":1,"a":2}', False)
    assert SO(json={"a": 2, "b": 1}).cache_key() != a.cache_key()
    assert SO(json_object=True, disable_any_whitespace=True).cache_key() == (
        "json_object",
        "",
        True,
    )


def _accepts(backend: XgrammarBackend, so: SO, text: str) -> bool:
    """Whether the grammar of ``so`` takes ``text`` (one character token at a time) whole."""
    matcher = backend.compile(so, 30.0).new_matcher()
    return all(matcher.accept_token(VOCAB.index(c)) for c in text) and matcher.accept_token(STOP)


def test_the_grammar_emits_properties_in_the_schemas_order(shared_backend) -> None:
    ordered = {
        "type": "object",
        "properties": {"b": {"type": "boolean"}, "a": {"type": "integer"}},
        "required": ["b", "a"],
        "additionalProperties": False,
    }
    so = SO(json=ordered, disable_any_whitespace=True)
    assert _accepts(shared_backend, so, '{"b": true, "a": 12}')
    assert not _accepts(shared_backend, so, '{"a": 12, "b": true}')


# -- backend -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (SO(regex="(["), "Unclosed"),
        (SO(json={"$ref": "#/$defs/missing"}), "Cannot find field"),
        (SO(grammar="root ::= "), "EBNF parser error"),
    ],
)
def test_library_errors_name_the_field_without_noise(shared_backend, so, match) -> None:
    with pytest.raises(RequestError, match=match) as info:
        shared_backend.compile(so, 30.0)
    assert info.value.field == so.field
    assert str(info.value).startswith(f"{so.field}: ")
    assert ".cc:" not in str(info.value)  # xgrammar's C++ location is stripped


def test_choice_grammar_escapes() -> None:
    choices = ['a"b', "c\\d", "e\nf", "ü"]
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB))
    matcher = xgr.GrammarCompiler(info).compile_grammar(choice_grammar(choices))
    for c in choices:
        m = xgr.GrammarMatcher(matcher)
        assert m.accept_string(c) and m.is_completed(), c


def test_bitmask_kernel_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_ref(want, bitmask, [4, 0, 2], [1, 0, 2])
    apply_token_bitmask(got, bitmask, [4, 0, 2], [1, 0, 2])
    assert torch.equal(want, got)
    assert want[1].isfinite().all() and not want[4].isfinite().all()


def test_bitmask_masks_before_bias_and_is_exact() -> None:
    vocab = 70
    logits = torch.zeros(3, vocab)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # token 5
    bitmask[1, 1] = -(2**31)  # bit 31 of word 1: token 63 (a negative int32)
    bitmask[1, 2] = 1 << 1  # token 65
    apply_token_bitmask_ref(logits, bitmask, [2, 0], [0, 1])
    assert (logits[2].isfinite().nonzero().flatten().tolist()) == [5]
    assert (logits[0].isfinite().nonzero().flatten().tolist()) == [63, 65]
    assert logits[1].isfinite().all()


# -- manager -----------------------------------------------------------------------------------


def test_compile_cache_hits_and_bound() -> None:
    m = StructuredOutputManager(backend, max_cache_entries=2)
    m.validate(SO(json=SCHEMA))
    m.validate(SO(json=json.dumps(SCHEMA)))  # same key, written differently
    assert (m.stats.num_compiles, m.stats.num_cache_hits) == (1, 1)
    m.validate(SO(regex="a+"))
    m.validate(SO(regex="b+"))  # evicts the schema (least recently used)
    assert not m.cached(SO(json=SCHEMA)) and m.cached(SO(regex="a+"))
    m.validate(SO(json=SCHEMA))
    assert m.stats.num_compiles == 4
    m.shutdown()


class _GatedBackend(XgrammarBackend):
    """A backend whose compiles wait for :attr:`gate` (a compile that takes long)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started = threading.Event()

    def compile(self, params, timeout_s):  # type: ignore[no-untyped-def]
        self.started.set()
        self.gate.wait()
        return super().compile(params, timeout_s)


def test_async_compile_does_not_block_a_running_batch(tiny) -> None:
    gated = _GatedBackend.from_vocab(VOCAB, STOP)
    core = make_core(tiny, StructuredOutputManager(lambda: gated))
    plain = make_request(None, max_tokens=5)
    constrained = make_request(SO(regex="[0-9]{3}"))
    core.add_request(plain)
    core.add_request(constrained)
    assert constrained.status == RequestStatus.WAITING_FOR_GRAMMAR
    gated.started.wait()
    scheduled = []
    while plain.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        sched = core.scheduler.schedule()
        scheduled.append([r.request_id for r in sched.scheduled_requests])
        core.scheduler.update_from_output(sched, core.executor.execute_model(sched))
    # The plain request ran its 5 steps alone while the grammar compiled.
    assert scheduled == [[plain.request_id]] * 5
    assert constrained.status == RequestStatus.WAITING_FOR_GRAMMAR
    gated.gate.set()
    assert constrained.structured_output is not None
    constrained.structured_output.future.result()  # type: ignore[union-attr]
    outs = run(core)
    assert re.fullmatch("[0-9]{3}", text_of(tokens(outs[constrained.request_id])))
    assert outs[constrained.request_id][-1].finish_reason == "stop"
    assert_idle(core)
    core.shutdown()


def test_abort_while_compiling_frees_everything(tiny) -> None:
    gated = _GatedBackend.from_vocab(VOCAB, STOP)
    manager = StructuredOutputManager(lambda: gated)
    core = make_core(tiny, manager)
    req = make_request(SO(regex="x+"))
    core.add_request(req)
    gated.started.wait()
    core.abort_requests([req.request_id])
    assert req.status == RequestStatus.FINISHED_ABORTED and req.structured_output is None
    assert not core.scheduler.requests and not core.scheduler.waiting
    assert_idle(core)
    gated.gate.set()  # the compile finishes into the cache, for the next request
    outs = run(core, again := make_request(SO(regex="x+"), max_tokens=4))
    assert set(text_of(tokens(outs[again.request_id]))) <= {"x"}
    assert manager.stats.num_compiles == 1
    core.shutdown()


def test_compile_timeout_fails_only_that_request(tiny) -> None:
    manager = StructuredOutputManager(backend, compile_timeout_s=1.0)
    core = make_core(tiny, manager)
    slow = make_request(SO(regex=SLOW_REGEX))
    plain = make_request(None, max_tokens=3)
    outs = run(core, slow, plain)
    (only,) = outs[slow.request_id]
    assert only.finish_reason == "abort" and only.new_token_ids == []
    assert isinstance(only.error, RequestError)
    assert only.error.field == "structured_outputs.regex"
    assert "did not compile within 1 s" in str(only.error)
    assert len(tokens(outs[plain.request_id])) == 3
    assert_idle(core)
    core.shutdown()


def test_a_compile_past_the_limit_is_killed_and_frees_its_worker() -> None:
    # One worker: before compiles ran in killable processes, the slow compile went on in
    # its thread after its request failed, and the next constraint waited behind it.
    b = backend(num_workers=1)
    manager = StructuredOutputManager(lambda: b, max_workers=1, compile_timeout_s=1.0)
    with pytest.raises(RequestError, match="did not compile within 1 s"):
        manager.validate(SO(regex=SLOW_REGEX))
    assert b.workers.num_killed == 1 and b.workers.pids() == []
    manager.validate(SO(regex="[0-9]{2}x"))
    assert manager.cached(SO(regex="[0-9]{2}x")) and not manager.cached(SO(regex=SLOW_REGEX))
    (pid,) = b.workers.pids()
    manager.shutdown()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_full_compile_queue_is_a_busy_error_not_a_bad_request(tiny) -> None:
    gated = _GatedBackend.from_vocab(VOCAB, STOP)
    now = [0.0]
    manager = StructuredOutputManager(
        lambda: gated, max_workers=1, max_queue_wait_s=0.5, max_pending=2, clock=lambda: now[0]
    )
    first = manager.compile_async(SO(regex="a+"))
    gated.started.wait()
    queued = manager.compile_async(SO(regex="b+"))  # waits for the one worker
    with pytest.raises(GrammarCompilerBusyError, match="2 compiles are queued"):
        manager.validate(SO(regex="c+"))
    now[0] += 0.6  # the queued compile has now waited past the limit
    gated.gate.set()
    first.result()
    with pytest.raises(GrammarCompilerBusyError, match="waited .* for a worker") as info:
        queued.result()
    assert info.value.field == "structured_outputs.regex"
    assert manager.stats.num_busy == 2
    manager.validate(SO(regex="b+"))  # nothing queued now: it compiles
    manager.shutdown()


def test_bad_grammar_is_an_output_error_in_the_engine(tiny) -> None:
    core = make_core(tiny)
    bad = make_request(SO(grammar="root ::= ("))
    outs = run(core, bad)
    (only,) = outs[bad.request_id]
    assert only.finish_reason == "abort"
    assert only.error is not None and only.error.field == "structured_outputs.grammar"
    with pytest.raises(RequestError, match="EBNF parser error"):
        core.check_structured_outputs(SO(grammar="root ::= ("))
    assert_idle(core)


# -- generation --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_each_kind_is_obeyed(tiny, seed) -> None:
    core = make_core(tiny)
    sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
    cases = [
        (
            SO(json=SCHEMA, disable_any_whitespace=True),
            lambda t: jsonschema.validate(json.loads(t), SCHEMA),
        ),
        (
            SO(json_object=True, disable_any_whitespace=True),
            lambda t: isinstance(json.loads(t), dict) or pytest.fail(t),
        ),
        (
            SO(regex="[a-c]{2,4}-[0-9]+"),
            lambda t: re.fullmatch("[a-c]{2,4}-[0-9]+", t) or pytest.fail(t),
        ),
        (SO(choice=["yes", "no", "ab"]), lambda t: t in {"yes", "no", "ab"} or pytest.fail(t)),
        (
            SO(grammar='root ::= "a" ("b" | "c")* "."'),
            lambda t: re.fullmatch(r"a[bc]*\.", t) or pytest.fail(t),
        ),
    ]
    reqs = [make_request(so, [5 + i, 7, 9], **sampled) for i, (so, _) in enumerate(cases)]
    outs = run(core, *reqs)
    num_length = 0
    for req, (so, check) in zip(reqs, cases, strict=True):
        steps = outs[req.request_id]
        if steps[-1].finish_reason == "length":
            num_length += 1
            continue  # random weights may wander (a number that never ends)
        assert steps[-1].finish_reason == "stop", so.kind
        assert tokens(steps)[-1] == STOP
        check(text_of(tokens(steps)))
    assert num_length <= 2
    assert_idle(core)


def test_logprobs_see_only_allowed_tokens(tiny) -> None:
    core = make_core(tiny)
    req = make_request(SO(choice=["yes", "no"]), logprobs=5, temperature=0.7, seed=3)
    outs = run(core, req)
    allowed_first = {VOCAB.index(t) for t in ("y", "n", "yes", "no")}
    first = outs[req.request_id][0].new_logprobs[0]
    assert set(first) <= allowed_first
    for o in outs[req.request_id]:
        for pos in o.new_logprobs:
            assert all(lp.logprob > float("-inf") for lp in pos.values())


def test_greedy_constrained_matches_unbatched_and_survives_preemption(tiny) -> None:
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    alone = make_request(so, [4, 5, 6])
    ref = tokens(run(make_core(tiny), alone)[alone.request_id])
    # A cache of 9 blocks of 4 tokens cannot hold three growing sequences: preemption.
    core = make_core(tiny, num_blocks=9)
    reqs = [make_request(so, [4, 5, 6]) for _ in range(3)]
    outs = run(core, *reqs)
    assert core.scheduler.num_preemptions > 0
    for r in reqs:
        assert tokens(outs[r.request_id]) == ref
    assert_idle(core)


def test_speculative_decoding_masks_every_verified_position(tiny) -> None:
    """With prompt-lookup drafts (the prompt holds grammar-valid and -invalid text),
    greedy constrained outputs equal those without speculation, and seeded sampled
    ones still obey their grammar: each draft position is verified under its mask."""
    prompt = [VOCAB.index(c) for c in '{"a":1234,"b":false} aaab.abcb.aab']
    cases = [
        SO(json=SCHEMA, disable_any_whitespace=True),
        SO(grammar='root ::= "a" ("b" | "c")* "."'),
        SO(regex="[a-c]{2,4}-[0-9]+"),
    ]
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                             acceptance_backoff=False)
    greedy = [make_request(so, prompt) for so in cases]
    want = run(make_core(tiny), *greedy)
    core = make_core(tiny, speculative=spec)
    again = [make_request(so, prompt) for so in cases]
    got = run(core, *again)
    for a, b in zip(greedy, again, strict=True):
        assert tokens(got[b.request_id]) == tokens(want[a.request_id])
    sampled = [make_request(so, prompt, temperature=1.0, seed=i) for i, so in enumerate(cases)]
    outs = run(core, *sampled)
    checks = [lambda t: jsonschema.validate(json.loads(t), SCHEMA),
              lambda t: re.fullmatch(r"a[bc]*\.", t) or pytest.fail(t),
              lambda t: re.fullmatch("[a-c]{2,4}-[0-9]+", t) or pytest.fail(t)]
    for req, check in zip(sampled, checks, strict=True):
        if outs[req.request_id][-1].finish_reason == "stop":
            check(text_of(tokens(outs[req.request_id])))
    st = core.get_stats().spec_decode
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    assert_idle(core)


def test_replayed_tokens_continue_the_grammar(tiny) -> None:
    """The decode side: a request arrives with its first token (sampled by prefill under
    the same grammar); the matcher replays it and continues."""
    so = SO(regex="[0-9]{2}-[0-9]{2}")
    whole = make_request(so, [3, 3])
    ref = tokens(run(make_core(tiny), whole)[whole.request_id])
    core = make_core(tiny)
    cont = make_request(so, [3, 3])
    cont.append_output_token(ref[0])
    outs = run(core, cont)
    assert [ref[0], *tokens(outs[cont.request_id])] == ref
    bad = make_request(so, [3, 3])
    bad.append_output_token(VOCAB.index("a"))
    (only,) = run(core, bad)[bad.request_id]
    assert only.finish_reason == "abort" and only.error is not None
    assert only.error.field == "first_token_id"
    assert_idle(core)
