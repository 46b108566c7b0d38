"""The offline engine on the real default model (SmolLM2-135M-Instruct), float32.

Oracle: transformers ``generate(do_sample=False)`` token for token. The model is
loaded once for the module (transformers from the GGUF; our model is built from
the same state dict) and shared by every engine built here. After every test each
engine's block pool is back to full: nothing leaks, aborts included.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine.llm_engine import OutputKind

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
TIE_GAP = 1e-4

LONG_TEXT = " ".join(
    f"Chapter {i}: the river town of Eldham kept its records in a stone archive, and each "
    f"year the keepers copied {i * 7 % 13 + 2} ledgers by hand before the spring floods."
    for i in range(1, 9)
)


@pytest.fixture(scope="module")
def real():
    """The HF model (oracle), its tokenizer, and our model built from the same weights."""
    from hf_oracle import hf_default_model

    from tandem.engine.model_files import load_tokenizer, model_id_of
    from tandem.engine.model_loader import LoadedModel
    from tandem.engine.models.registry import build_model

    hf = hf_default_model()
    tok = load_tokenizer(None)
    max_pos = hf.config.max_position_embeddings
    model = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", max_pos)
    loaded = LoadedModel(
        model=model,
        hf_config=hf.config,
        tokenizer=tok,
        model_id=model_id_of(None),
        dtype=torch.float32,
        device=torch.device("cpu"),
        eos_token_id=tok.eos_token_id,
        max_position=max_pos,
    )
    engines: list[LLM] = []

    def make_llm(**kwargs) -> LLM:
        kwargs.setdefault("kv_cache_memory", 96 << 20)
        kwargs.setdefault("max_model_len", 2048)
        llm = LLM(dtype="float32", loaded=loaded, **kwargs)
        engines.append(llm)
        return llm

    return SimpleNamespace(
        hf=hf, tok=tok, loaded=loaded, make_llm=make_llm, engines=engines, cache={}
    )


@pytest.fixture(scope="module")
def llm(real) -> LLM:
    return real.make_llm()


@pytest.fixture(autouse=True)
def pools_back_to_full(real):
    yield
    for engine in real.engines:
        core = engine.llm_engine.engine_core
        pool = core.scheduler.kv_cache_manager.block_pool
        assert not engine.llm_engine.has_unfinished_requests()
        assert pool.num_free_blocks == pool.num_blocks, "KV blocks leaked"


def chat_ids(tok, text: str, system: str | None = None) -> list[int]:
    conv = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    s = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return tok.encode(s, add_special_tokens=False)


def hf_greedy(real, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers greedy: tokens (up to and including EOS) and per-step logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = real.hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            eos_token_id=real.tok.eos_token_id,
            pad_token_id=real.tok.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [lg[0] for lg in out.logits]


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(logprobs_or_logits) -> float:
    if isinstance(logprobs_or_logits, torch.Tensor):
        v = logprobs_or_logits.topk(2).values
        return float(v[0] - v[1])
    vals = sorted((lp.logprob for lp in logprobs_or_logits.values()), reverse=True)
    return vals[0] - vals[1]


def assert_same_or_tie(a: list[int], b: list[int], logprobs_a, logprobs_b=None) -> None:
    """Equal, or first different where the top-2 gap is under ``TIE_GAP`` (a float tie)."""
    i = first_diff(a, b)
    if i is None:
        return
    assert i < min(len(a), len(b)), f"lengths differ without a token difference: {a} vs {b}"
    gaps = [top2_gap(lp[i]) for lp in (logprobs_a, logprobs_b) if lp is not None]
    assert min(gaps) < TIE_GAP, f"tokens differ at {i}: {a} vs {b} (top-2 gaps {gaps})"


def prompts_mixed(tok) -> list[list[int]]:
    """8 prompts, 1 token to several hundred, raw and chat-templated."""
    return [
        tok.encode("Hello")[:1],
        tok.encode("The capital of France is"),
        tok.encode("def fibonacci(n):\n    "),
        tok.encode("Once upon a time, in a small village,"),
        chat_ids(tok, "What is 2+2?"),
        chat_ids(tok, "Write a short poem about the ocean.", system="You are a poet."),
        chat_ids(tok, "Summarize this text in one sentence:\n" + LONG_TEXT),
        tok.encode(LONG_TEXT + " The keepers"),
    ]


# -- greedy vs transformers ------------------------------------------------------------


def test_greedy_matches_transformers(real, llm) -> None:
    prompts = prompts_mixed(real.tok)
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) >= 300, lengths
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref, logits = hf_greedy(real, prompt, NEW_TOKENS)
        ours = out.outputs[0].token_ids
        assert_same_or_tie(ours, ref, None, logits)
        if ours == ref:
            expected = "stop" if ref[-1] == real.tok.eos_token_id else "length"
            assert out.outputs[0].finish_reason == expected


def test_transformers_model_impl_equals_native(real, llm) -> None:
    """``model_impl="transformers"`` (transformers' own modeling code over tandem's paged
    attention) on the real default model gives the native implementation's float32 greedy
    tokens, prompt for prompt, in one batch with chunked prefill."""
    from dataclasses import replace

    from tandem.engine.models.registry import build_model

    hf_model = build_model(real.hf.config, real.hf.state_dict(), torch.float32, "cpu",
                           real.loaded.max_position, model_impl="transformers")
    loaded = replace(real.loaded, model=hf_model, model_impl="transformers")
    other = LLM(dtype="float32", loaded=loaded, kv_cache_memory=96 << 20, max_model_len=2048,
                max_num_batched_tokens=256)
    real.engines.append(other)
    assert other.llm_engine.engine_core.model_facts.model_impl == "transformers"
    # The GGUF's config names no architectures: the facts (/v1/models, GetLoad) still do.
    assert llm.llm_engine.engine_core.model_facts.architecture == "LlamaForCausalLM"
    assert other.llm_engine.engine_core.model_facts.architecture == "LlamaForCausalLM"
    prompts = prompts_mixed(real.tok)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    native = llm.generate(prompts, params, False)
    through_hf = other.generate(prompts, params, False)
    for prompt, a, b in zip(prompts, native, through_hf, strict=True):
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids), len(prompt)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_pipeline_parallel_matches_transformers(real) -> None:
    """The real model split into 2 pipeline stages (worker processes over gloo; its 9
    attention heads do not split at TP=2) gives transformers' greedy tokens."""
    prompts = prompts_mixed(real.tok)[:6]  # the two longest left out: one core per stage
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    with LLM(dtype="float32", kv_cache_memory=96 << 20, max_model_len=2048,
             pipeline_parallel_size=2) as llm:
        outs = llm.generate(prompts, params, False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref, logits = hf_greedy(real, prompt, NEW_TOKENS)
        assert_same_or_tie(out.outputs[0].token_ids, ref, None, logits)


def test_logprobs_match_transformers(real, llm) -> None:
    prompt = chat_ids(real.tok, "Name a color.")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref, logits = hf_greedy(real, prompt, 6)
    assert len(out.logprobs) == len(out.token_ids) == 6
    total = 0.0
    for tok_id, pos, lg in zip(out.token_ids, out.logprobs, logits, strict=False):
        expected = torch.log_softmax(lg.float(), dim=-1)
        top = expected.topk(5)
        assert pos[tok_id].rank == 1
        assert set(pos) == set(top.indices.tolist())
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(pos[t].logprob - v) < 1e-3
        assert pos[tok_id].decoded_token == real.tok.decode([tok_id])
        total += pos[tok_id].logprob
    assert out.cumulative_logprob == pytest.approx(total)


# -- batch composition and engine settings ------------------------------------------------


def test_alone_equals_in_batch_of_16(real, llm) -> None:
    tok = real.tok
    base = prompts_mixed(tok)
    prompts = base + [p[: max(1, len(p) // 3)] for p in base]
    assert len(prompts) == 16
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    batch = llm.generate(prompts, params, use_tqdm=False)
    alone_llm = real.make_llm(enable_prefix_caching=False)
    for prompt, out in zip(prompts, batch, strict=True):
        alone = alone_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        o = out.outputs[0]
        assert_same_or_tie(o.token_ids, alone.token_ids, o.logprobs, alone.logprobs)


@pytest.mark.parametrize(
    "settings",
    [
        {"enable_prefix_caching": False},
        {"enable_chunked_prefill": False},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
        {"num_blocks": 30, "kv_cache_memory": None},
    ],
    ids=["prefix-cache-off", "chunked-off", "chunked-64", "preemption"],
)
def test_settings_give_same_tokens(real, llm, settings) -> None:
    prompts = prompts_mixed(real.tok)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
    if "settings" not in real.cache:
        real.cache["settings"] = llm.generate(prompts, params, use_tqdm=False)
    ref = real.cache["settings"]
    other = real.make_llm(**settings)
    outs = other.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, outs, strict=True):
        oa, ob = a.outputs[0], b.outputs[0]
        assert_same_or_tie(oa.token_ids, ob.token_ids, oa.logprobs, ob.logprobs)
    if "num_blocks" in settings:
        assert other.llm_engine.engine_core.get_stats().num_preemptions > 0


def test_speculative_ngram_gives_same_tokens(real, llm) -> None:
    """Prompt lookup (k = 3) on the real model: the greedy tokens (ties aside) of the
    engine without it, with drafts accepted on the prompts that quote their text."""
    p = prompts_mixed(real.tok)
    prompts = [p[2], p[6], p[7]]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    ref = llm.generate(prompts, params, use_tqdm=False)
    spec = real.make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outs = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(ref, outs, strict=True):
        oa, ob = a.outputs[0], b.outputs[0]
        assert_same_or_tie(oa.token_ids, ob.token_ids, oa.logprobs, ob.logprobs)
    stats = spec.llm_engine.engine_core.get_stats().spec_decode
    assert stats.num_accepted_tokens > 0, stats


def test_prefix_cache_hits_give_same_tokens(real, llm) -> None:
    prompt = real.tok.encode(LONG_TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    hits_before = llm.llm_engine.engine_core.get_stats().prefix_cache_hits
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(prompt) - 16
    assert llm.llm_engine.engine_core.get_stats().prefix_cache_hits > hits_before
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


# -- sampling --------------------------------------------------------------------------


def test_seeded_sampling_reproducible_across_batches(real, llm) -> None:
    tok = real.tok
    target = chat_ids(tok, "Tell me a fun fact.")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    alone = llm.generate([target], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts_mixed(tok)[:5]
    batch_params = [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=0.7, max_tokens=20),
        SamplingParams(temperature=1.0, seed=99, max_tokens=5),
        seeded,
        SamplingParams(temperature=1.2, top_k=20, max_tokens=16),
        SamplingParams(temperature=0.9, max_tokens=12),
    ]
    batch = [*others[:3], target, *others[3:]]
    outs = llm.generate(batch, batch_params, use_tqdm=False)
    assert outs[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_greater_than_one(real, llm) -> None:
    prompt = real.tok.encode(LONG_TEXT[:400])
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    hits_before = llm.llm_engine.engine_core.get_stats().prefix_cache_hits
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "children must differ"
    # Children 1 and 2 reuse child 0's prompt blocks from the prefix cache.
    hits = llm.llm_engine.engine_core.get_stats().prefix_cache_hits - hits_before
    assert hits >= 2 * (len(prompt) // 16 - 1) * 16
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    g = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids


# -- stop conditions and finish reasons --------------------------------------------------


def test_stop_strings(real, llm) -> None:
    prompt = chat_ids(real.tok, "Write a short poem about the ocean.")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    words = full.split()
    stop = words[len(words) // 2]
    cut = full.index(stop)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == full[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    inc = SamplingParams(
        temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
    )
    out = llm.generate([prompt], inc, use_tqdm=False)[0].outputs[0]
    assert out.text == full[: cut + len(stop)]

    # Streaming: deltas never show a part of the stop string and add up to the text.
    engine = llm.llm_engine
    engine.add_request(
        "s",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
        kind=OutputKind.DELTA,
    )
    deltas = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.outputs[0].text)
    assert "".join(deltas) == full[:cut]


def test_finish_reasons_length_eos_and_stop_token(real, llm) -> None:
    tok = real.tok
    prompt = chat_ids(tok, "Reply with just the word yes.")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200), False)[0]
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids[-1]) == ("stop", None, tok.eos_token_id)
    assert tok.eos_token not in c.text
    stop_tok = c.token_ids[2]
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=200, stop_token_ids=[stop_tok]),
        False,
    )[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    assert out.token_ids == c.token_ids[: c.token_ids.index(stop_tok) + 1]
    # min_tokens keeps EOS away: the answer runs past its natural end.
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=200, min_tokens=len(c.token_ids) + 3),
        False,
    )[0].outputs[0]
    assert len(out.token_ids) > len(c.token_ids) + 3
    assert tok.eos_token_id not in out.token_ids[: len(c.token_ids) + 3]


def test_aborts_at_every_stage_free_blocks(real) -> None:
    llm = real.make_llm(max_num_batched_tokens=48)
    engine = llm.llm_engine
    tok = real.tok
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    survivor = chat_ids(tok, "What is 2+2?")
    expected = llm.generate([survivor], params, use_tqdm=False)[0].outputs[0].token_ids

    engine.add_request("long", tok.encode(LONG_TEXT), params)  # needs several chunks
    engine.add_request("dec", tok.encode("The capital of France is"), params)
    engine.add_request("keep", survivor, params)
    engine.add_request("queued", tok.encode("Never scheduled"), params)
    engine.abort_request("queued")  # waiting
    outs = {o.request_id: o for o in engine.step()}
    assert outs["queued"].finished and outs["queued"].outputs[0].finish_reason == "abort"
    engine.abort_request("long")  # mid-prefill
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == "dec" and len(o.outputs[0].token_ids) >= 2 and not o.finished:
                engine.abort_request("dec")  # decoding
            if o.finished:
                finals[o.request_id] = o.outputs[0]
    assert finals["long"].finish_reason == "abort" and finals["long"].token_ids == []
    assert finals["dec"].finish_reason == "abort" and len(finals["dec"].token_ids) >= 2
    assert finals["keep"].finish_reason == "length"
    assert finals["keep"].token_ids == expected
    engine.abort_request("keep")  # finished already: ignored
    assert engine.step() == []


# -- detokenization ----------------------------------------------------------------------


def test_streamed_cjk_text_never_broken(real, llm) -> None:
    tok = real.tok
    prompts = [
        chat_ids(tok, 'Translate "good morning" into Chinese.'),
        chat_ids(tok, 'Write the Chinese characters for "I love you".'),
        tok.encode("Emoji list: 😀 😃 😄 😁 😆"),
        tok.encode("Fruits: 🍎 apple, 🍌 banana, 🍇"),
    ]
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for i, p in enumerate(prompts):
        engine.add_request(f"mb{i}", p, params, kind=OutputKind.DELTA)
    deltas: dict[str, list[str]] = {f"mb{i}": [] for i in range(len(prompts))}
    ids: dict[str, list[int]] = {k: [] for k in deltas}
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas[o.request_id].append(o.outputs[0].text)
            ids[o.request_id] += o.outputs[0].token_ids
    multibyte = 0
    for rid, chunks in deltas.items():
        text = "".join(chunks)
        assert all("\ufffd" not in c for c in chunks), chunks
        assert text == tok.decode(ids[rid], skip_special_tokens=True).rstrip("\ufffd")
        multibyte += sum(ord(ch) > 0xFFF for ch in text)
    assert multibyte > 5, deltas


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: SamplingParams(top_k=0), "top_k"),
        (lambda: SamplingParams(n=0), "n"),
    ],
)
def test_bad_sampling_params(make, field) -> None:
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt_token_ids"),
        (list(range(100, 2148)), SamplingParams(), "max_model_len"),
        ([5, 49152], SamplingParams(), r"prompt_token_ids.*\[0, 49152\)"),
        ([-1, 5], SamplingParams(), "prompt_token_ids"),
        ([5, 6], SamplingParams(logit_bias={60000: 1.0}), "logit_bias"),
        ([5, 6], SamplingParams(stop_token_ids=[49152]), "stop_token_ids"),
        (["not", "ids"], SamplingParams(), "prompt"),
    ],
    ids=[
        "empty-text",
        "empty-ids",
        "too-long",
        "id-too-big",
        "id-negative",
        "bias-vocab",
        "stop-id-vocab",
        "bad-type",
    ],
)
def test_bad_requests_rejected_and_engine_keeps_serving(real, llm, prompt, params, field) -> None:
    good = [real.tok.encode("The capital of France is")]
    with pytest.raises(ValueError, match=field):
        llm.generate([*good, prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests(), "nothing may be queued"
    out = llm.generate(good, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_unknown_model_path() -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/model/folder")
