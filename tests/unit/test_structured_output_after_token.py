"""Structured outputs that start after a token (``StructuredOutputsParams.after_token_id``):
a reasoning model's thinking is free, its answer after ``</think>`` is constrained.

The engine serves a scripted tiny Llama: its layers add nothing to the residual stream,
so each next token depends on the last token alone, and greedy decoding of a prompt that
does not end in a script token emits ``x``, ``y``, ``</think>``, then wants ``z`` for
ever. Neither ``x`` nor ``y`` nor ``z`` is allowed by the grammars used here, so an
output that holds them before ``</think>`` was not masked there, and an answer that
parses after it was.
"""

from __future__ import annotations

import itertools
import json
import re

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
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sampling_params import StructuredOutputsParams as SO
from tandem.engine.structured_output.backend import XgrammarBackend
from tandem.engine.structured_output.manager import StructuredOutputManager
from tandem.engine.validation import RequestError, check_vocab_params

_CHARS = list('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ{}[]":, \n.-_')
VOCAB = _CHARS + ["true", "false", '{"', '":', "</think>"]
VOCAB += [f"<unused{i}>" for i in range(96 - len(VOCAB))]
STOP = len(VOCAB)
VOCAB.append("</s>")
END = VOCAB.index("</think>")
X, Y, Z, W = (VOCAB.index(c) for c in "xyzw")
MAX_LEN = 64
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
def scripted() -> LoadedModel:
    chain = [X, Y, END, Z]
    hidden = 32
    config = tiny_config("LlamaForCausalLM", vocab=len(VOCAB), hidden=hidden, ffn=64,
                         max_len=MAX_LEN, special_tokens=False, tie_word_embeddings=False)
    model = tiny_hf_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[:, 0] = 1.0  # any token off the chain: its successor is chain[0]
        head[chain[0], 0] = 4.0
        for i, t in enumerate(chain):
            embed[t] = 0.0
            embed[t, i + 1] = 1.0
            head[chain[min(i + 1, len(chain) - 1)], i + 1] = 4.0  # z wants z
    return as_loaded_model(model, "scripted-think", MAX_LEN)


@pytest.fixture(scope="module")
def backend():
    b = XgrammarBackend.from_vocab(VOCAB, STOP, 1)
    yield b
    b.shutdown()


def make_core(loaded: LoadedModel, backend: XgrammarBackend,
              speculative: SpeculativeConfig | None = None) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=4, num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        speculative=speculative,
    )
    return EngineCore(config, create_executor(config, loaded),
                      StructuredOutputManager(lambda: backend))


def make_request(so: SO | None, prompt: list[int] | None = None) -> Request:
    params = SamplingParams(structured_outputs=so, temperature=0.0, max_tokens=40)
    return Request(f"r{next(_ids)}", prompt or [W, W], params)


def tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def answer_after_end(ids: list[int]) -> tuple[list[int], str]:
    """(the tokens up to and including ``</think>``, the text after it)."""
    cut = ids.index(END) + 1
    return ids[:cut], text_of(ids[cut:])


@pytest.mark.parametrize("so, check", [
    (SO(json=SCHEMA, disable_any_whitespace=True, after_token_id=END),
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    (SO(regex="[0-9]{2}", after_token_id=END),
     lambda t: re.fullmatch("[0-9]{2}", t) or pytest.fail(t)),
])
def test_thinking_is_free_and_the_answer_is_constrained(scripted, backend, so, check) -> None:
    core = make_core(scripted, backend)
    req = make_request(so)
    steps = run(core, req)[req.request_id]
    ids = tokens(steps)
    assert steps[-1].finish_reason == "stop" and ids[-1] == STOP
    thinking, answer = answer_after_end(ids)
    assert thinking == [X, Y, END]  # the grammar forbids x and y: nothing masked them
    check(answer)
    assert Z not in ids  # what the model wants after </think>: masked


def test_without_the_token_the_grammar_applies_from_the_start(scripted, backend) -> None:
    core = make_core(scripted, backend)
    req = make_request(SO(regex="[0-9]{2}"))
    ids = tokens(run(core, req)[req.request_id])
    assert re.fullmatch("[0-9]{2}", text_of(ids)), text_of(ids)


def test_cut_before_the_token_is_all_free(scripted, backend) -> None:
    """No ``</think>`` within ``max_tokens``: no token was masked, and the grammar's
    completion does not finish the request."""
    core = make_core(scripted, backend)
    req = Request("cut", [W], SamplingParams(
        structured_outputs=SO(regex="[0-9]{2}", after_token_id=VOCAB.index("a")),
        temperature=0.0, max_tokens=6))
    steps = run(core, req)["cut"]
    assert tokens(steps) == [X, Y, END, Z, Z, Z]
    assert steps[-1].finish_reason == "length"


def test_speculative_drafts_across_the_token_match_plain_decoding(scripted, backend) -> None:
    """Prompt-lookup drafts hold ``</think>`` mid-draft: the positions up to it are free,
    the ones after it masked; greedy output equals decoding without speculation."""
    so = SO(json=SCHEMA, disable_any_whitespace=True, after_token_id=END)
    prompt = [X, Y, END, *(VOCAB.index(c) for c in "{}0"), W]
    want = tokens(run(make_core(scripted, backend), r := make_request(so, prompt))[r.request_id])
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                             acceptance_backoff=False)
    core = make_core(scripted, backend, speculative=spec)
    got = tokens(run(core, r2 := make_request(so, prompt))[r2.request_id])
    assert got == want
    assert answer_after_end(got)[0] == [X, Y, END]
    assert core.get_stats().spec_decode.num_draft_tokens > 0


def test_replayed_tokens_skip_the_thinking(scripted, backend) -> None:
    """A request continued elsewhere (a decode instance) arrives with output tokens: the
    matcher replays only those after ``</think>``; a bad one after it fails the request
    naming its position."""
    so = SO(regex="[0-9]{2}", after_token_id=END)
    core = make_core(scripted, backend)
    cont = make_request(so)
    for t in (X, Y, END, VOCAB.index("4")):
        cont.append_output_token(t)
    ids = tokens(run(core, cont)[cont.request_id])
    assert re.fullmatch("[0-9]", text_of(ids)), ids
    bad = make_request(so)
    for t in (X, END, Y):
        bad.append_output_token(t)
    (only,) = run(core, bad)[bad.request_id]
    assert only.finish_reason == "abort" and only.error is not None
    assert only.error.field == "output_token_ids" and "position 2" in str(only.error)


def test_after_token_id_is_checked_naming_the_field() -> None:
    for bad in (-1, "5", True):
        with pytest.raises(RequestError) as err:
            SO(regex="a", after_token_id=bad)
        assert err.value.field == "structured_outputs.after_token_id"
    params = SamplingParams(structured_outputs=SO(regex="a", after_token_id=len(VOCAB)))
    with pytest.raises(RequestError) as err:
        check_vocab_params(params, len(VOCAB))
    assert err.value.field == "structured_outputs.after_token_id"
    check_vocab_params(SamplingParams(structured_outputs=SO(regex="a", after_token_id=END)),
                       len(VOCAB))


def test_after_token_id_survives_the_proto() -> None:
    from tandem.contracts.proto import structured_outputs_from_proto, structured_outputs_to_proto

    for so in (SO(json=SCHEMA, after_token_id=END), SO(choice=["a"], after_token_id=0),
               SO(regex="a")):
        msg = structured_outputs_to_proto(so)
        assert msg.HasField("after_token_id") == (so.after_token_id is not None)
        assert structured_outputs_from_proto(msg) == so
