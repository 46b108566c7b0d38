"""A checkpoint's calibrated KV cache scales (``engine/models/kv_scales.py``): read under
each name FP8 checkpoints use, applied by an FP8 cache (fingerprint and logprobs), harmless
to an ``auto`` cache, refused where an implementation cannot apply them."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy_steps, tiny_config, tiny_hf_model

from tandem.engine.llm import LLM
from tandem.engine.model_loader import LoadedModel
from tandem.engine.models.kv_scales import kv_scale_target
from tandem.engine.models.registry import build_model
from tandem.engine.sampling_params import SamplingParams

VOCAB, MAX_LEN, BLOCK = 97, 128, 4
PROMPTS = [list(range(3, 20)), list(range(40, 71)), [5, 9, 11, 60, 61, 2, 7]]


@pytest.fixture(scope="module")
def tiny_hf():
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=64, ffn=96, max_len=MAX_LEN,
                         special_tokens=False)
    return tiny_hf_model(config, std=0.5)


def _calibrated(hf) -> dict[str, torch.Tensor]:
    """The per-layer scales a calibration would write: max |K| (|V|) over the prompts /
    448 (e4m3's largest value), doubled for the rotary rotation of K's pairs."""
    amax: dict[str, float] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for which, proj in (("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj)):
            key = f"model.layers.{i}.self_attn.{which}_scale"

            def hook(_m, _inp, out, key=key):
                amax[key] = max(amax.get(key, 0.0), float(out.abs().max()))
            hooks.append(proj.register_forward_hook(hook))
    with torch.no_grad():
        for p in PROMPTS:
            hf(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return {k: torch.tensor(2.0 * v / 448.0) for k, v in amax.items()}


def _loaded(hf, extra: dict[str, torch.Tensor], impl: str = "auto") -> LoadedModel:
    weights = {**hf.state_dict(), **extra}
    model = build_model(hf.config, weights, torch.float32, "cpu", MAX_LEN, impl)
    return LoadedModel(model=model, hf_config=hf.config, tokenizer=None, model_id="tiny",
                       dtype=torch.float32, device=torch.device("cpu"), eos_token_id=None,
                       max_position=MAX_LEN)


def _generate(loaded: LoadedModel, kv_cache_dtype: str):
    llm = LLM(dtype="float32", loaded=loaded, block_size=BLOCK, max_model_len=MAX_LEN,
              num_blocks=128, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return llm, outs


@pytest.mark.parametrize(("name", "want"), [
    ("model.layers.3.self_attn.k_scale", ("model.layers.3.self_attn", "k")),
    ("model.layers.0.self_attn.v_scale", ("model.layers.0.self_attn", "v")),
    ("model.layers.1.self_attn.k_proj.output_scale", ("model.layers.1.self_attn", "k")),
    ("model.layers.1.self_attn.v_proj.output_scale", ("model.layers.1.self_attn", "v")),
    ("model.layers.2.self_attn.kv_scale", ("model.layers.2.self_attn", "kv")),
    ("model.layers.2.self_attn.k_proj.weight", None),
    ("model.layers.2.self_attn.k_proj.weight_scale", None),
])
def test_scale_names(name, want) -> None:
    assert kv_scale_target(name) == want


def test_scales_reach_the_attention_layers(tiny_hf) -> None:
    extra = {"model.layers.0.self_attn.k_scale": torch.tensor([0.25]),
             "model.layers.0.self_attn.v_scale": torch.tensor(0.5),
             "model.layers.1.self_attn.kv_scale": torch.tensor(0.125)}
    model = _loaded(tiny_hf, extra).model
    attn = [layer.self_attn for layer in model.model.layers]
    assert (attn[0].k_scale, attn[0].v_scale) == (0.25, 0.5)
    assert (attn[1].k_scale, attn[1].v_scale) == (0.125, 0.125)


@pytest.mark.parametrize("bad", [torch.tensor([0.1, 0.2]), torch.tensor(0.0),
                                 torch.tensor(float("nan"))])
def test_a_bad_scale_names_the_tensor(tiny_hf, bad) -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_scale"):
        _loaded(tiny_hf, {"model.layers.0.self_attn.k_scale": bad})


def test_auto_cache_ignores_the_scales_and_fp8_applies_them(tiny_hf) -> None:
    scales = _calibrated(tiny_hf)
    plain, calibrated = _loaded(tiny_hf, {}), _loaded(tiny_hf, scales)
    # a cache in the model's dtype: transformers' tokens, scales or not
    for loaded in (plain, calibrated):
        _, outs = _generate(loaded, "auto")
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.token_ids == hf_greedy_steps(tiny_hf, prompt, 10)[0]
    # FP8: the scales are the cache's (a layout of its own) and stay close to auto
    llm_plain, _ = _generate(plain, "fp8")
    llm_cal, got = _generate(calibrated, "fp8")
    facts = [llm.llm_engine.engine_core.model_facts for llm in (llm_plain, llm_cal)]
    assert facts[0].kv_scales != facts[1].kv_scales
    _, want = _generate(calibrated, "auto")
    for a, b in zip(want, got, strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True))
                     if x != y),
                    None)
        assert diff is None or (b.token_ids[diff] in a.logprobs[diff]
                                and a.token_ids[diff] in b.logprobs[diff])


def test_fp8_refused_where_the_scales_cannot_apply(tiny_hf) -> None:
    """The Transformers backend takes no KV scales: an auto cache runs (the scales change
    nothing there), an FP8 one is refused naming kv_cache_dtype."""
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}
    loaded = _loaded(tiny_hf, scales, impl="transformers")
    assert loaded.model.ignored_kv_scales == ["model.layers.0.self_attn.k_scale"]
    _generate(loaded, "auto")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: .* calibrated KV cache scales"):
        _generate(loaded, "fp8")
