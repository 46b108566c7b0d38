"""The Transformers modeling backend's refusals and load errors, and the explicit-score
attention path (softcapping, sinks) it relies on; the end-to-end token checks are in
``tests/e2e/test_transformers_backend.py``."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import tiny_hf_model

from tandem.engine import distributed
from tandem.engine.config import ModelConfig
from tandem.engine.models import transformers_backend
from tandem.engine.models.registry import build_model, resolve_model_impl
from tandem.kernels.attention import build_attention_metadata, paged_attention
from tandem.kernels.cache import reshape_and_cache


def tiny(cls: str, arch: str, **extra) -> transformers.PretrainedConfig:
    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 64, **extra}
    return getattr(transformers, cls)(architectures=[arch], **sizes)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (transformers.MambaConfig(architectures=["MambaForCausalLM"]), "not a KV cache"),
        (transformers.RwkvConfig(architectures=["RwkvForCausalLM"]), "not a KV cache"),
        (transformers.Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"]),
         "not a KV cache"),
        (transformers.T5Config(architectures=["T5ForConditionalGeneration"]), "encoder-decoder"),
        (transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"]),
         "multimodal.*vision_config"),
        (transformers.LlamaConfig(architectures=["MyHybridForCausalLM"], num_hidden_layers=2,
                                  layer_types=["full_attention", "linear_attention"]),
         r"\['linear_attention'\].*layer_types"),
    ],
    ids=["mamba", "rwkv", "qwen3-next", "t5", "gemma3-vision", "layer-types"],
)
def test_refused_at_load_naming_architecture_and_reason(config, reason) -> None:
    arch = config.architectures[0]
    with pytest.raises(ValueError, match=reason) as err:
        resolve_model_impl(config, "transformers")
    assert arch in str(err.value)
    # auto: neither implementation serves it, and the error names both
    with pytest.raises(ValueError, match="native implementations cover.*LlamaForCausalLM") as err:
        resolve_model_impl(config, "auto")
    assert arch in str(err.value) and "model_impl='transformers'" in str(err.value)


def test_resolve_model_impl() -> None:
    llama = tiny("LlamaConfig", "LlamaForCausalLM")
    # OLMo 2: no native implementation (Gemma 2, once the example, has one now)
    olmo = tiny("Olmo2Config", "Olmo2ForCausalLM")
    assert resolve_model_impl(llama, "auto") == "tandem"
    assert resolve_model_impl(llama, "transformers") == "transformers"
    assert resolve_model_impl(olmo, "auto") == "transformers"
    with pytest.raises(ValueError, match="Olmo2ForCausalLM.*no native tandem implementation"):
        resolve_model_impl(olmo, "tandem")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        resolve_model_impl(llama, "vllm")
    with pytest.raises(ValueError, match="model_impl must be one of auto, tandem, transformers"):
        ModelConfig(model_impl="native")  # type: ignore[arg-type]


def test_tensor_and_pipeline_parallel_refused(monkeypatch) -> None:
    class Group:
        def __init__(self, n: int) -> None:
            self.world_size = n

    config = tiny("Gemma2Config", "Gemma2ForCausalLM", head_dim=16)
    monkeypatch.setattr(distributed, "get_tp_group", lambda: Group(2))
    with pytest.raises(ValueError, match="tensor_parallel_size 2.*Gemma2ForCausalLM"):
        transformers_backend.TransformersForCausalLM(config, max_position=64)
    monkeypatch.setattr(distributed, "get_tp_group", lambda: Group(1))
    monkeypatch.setattr(distributed, "get_pp_group", lambda: Group(2))
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        transformers_backend.TransformersForCausalLM(config, max_position=64)


@pytest.fixture(scope="module")
def gemma() -> transformers.PreTrainedModel:
    return tiny_hf_model(tiny("Gemma2Config", "Gemma2ForCausalLM", head_dim=16), std=0.05)


def test_weights_that_do_not_fit_name_the_tensor(gemma) -> None:
    def build(state):
        return build_model(gemma.config, state, torch.float32, "cpu", 64, "transformers")

    state = dict(gemma.state_dict())
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        build(missing)
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        build({**state, "model.layers.0.extra.weight": torch.zeros(3)})
    wrong = {**state, "model.norm.weight": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"wrong shape.*model\.norm\.weight"):
        build(wrong)
    with pytest.raises(ValueError, match="max_model_len 65 exceeds"):
        build_model(gemma.config, state, torch.float32, "cpu", 65, "transformers")


def test_unknown_logit_transform_is_refused(gemma, monkeypatch) -> None:
    """The load-time probe compares ``compute_logits``' head and transforms (``_logits``)
    with the model's own logits: a transform tandem does not apply (here Gemma 2's final
    softcapping, left out) is an error at load, never silently different logits."""
    plain = transformers_backend.TransformersForCausalLM._logits

    def without_softcap(self, hidden):
        return self.hf.get_output_embeddings()(hidden)

    monkeypatch.setattr(transformers_backend.TransformersForCausalLM, "_logits",
                        without_softcap)
    config = tiny("Gemma2Config", "Gemma2ForCausalLM", head_dim=16, final_logit_softcapping=0.5)
    hf = tiny_hf_model(config, std=0.5)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.*unknown logit transform"):
        build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 64, "transformers")
    monkeypatch.setattr(transformers_backend.TransformersForCausalLM, "_logits", plain)
    build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 64, "transformers")


def dense_reference(q, k, v, q_pos, scale, window, softcap, sinks):
    """One sequence's attention by the textbook formula (transformers' eager attention):
    ``q [n, H, D]`` at ``q_pos``, ``k, v [L, KVH, D]`` at positions ``0..L-1``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k.double()) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    k_pos = torch.arange(k.shape[0])
    see = k_pos[None, :] <= q_pos[:, None]
    if window:
        see &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~see[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hnl,lhd->nhd", p, v.double()).float()


@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize(("softcap", "with_sinks", "window"),
                         [(None, False, None), (5.0, False, None), (None, True, 6),
                          (3.0, True, None)])
def test_paged_attention_softcap_and_sinks_match_dense(head_dim, softcap, with_sinks,
                                                       window) -> None:
    """Decodes, a fresh prompt, a prompt after a cached prefix and a later chunk in one
    step, against the dense formula per sequence; head sizes 16 and 24."""
    torch.manual_seed(0)
    heads, kv_heads, bs = 4, 2, 4
    query_lens, computed = [1, 1, 9, 5, 7], [6, 13, 0, 8, 4]
    tables = [[i * 8 + j for j in range(8)] for i in range(len(query_lens))]
    k_cache = torch.randn(64, bs, kv_heads, head_dim)
    v_cache = torch.randn(64, bs, kv_heads, head_dim)
    seqs_k = [torch.randn(c + n, kv_heads, head_dim) for n, c in zip(query_lens, computed, strict=True)]
    seqs_v = [torch.randn(c + n, kv_heads, head_dim) for n, c in zip(query_lens, computed, strict=True)]
    # the cached prefix of each sequence, written as an earlier step would have
    for t, (k, v, c) in enumerate(zip(seqs_k, seqs_v, computed, strict=True)):
        for pos in range(c):
            blk, off = tables[t][pos // bs], pos % bs
            k_cache[blk, off], v_cache[blk, off] = k[pos], v[pos]
    meta = build_attention_metadata(query_lens, computed, tables, bs)
    key = torch.cat([k[c:] for k, c in zip(seqs_k, computed, strict=True)])
    value = torch.cat([v[c:] for v, c in zip(seqs_v, computed, strict=True)])
    query = torch.randn(key.shape[0], heads, head_dim)
    sinks = torch.randn(heads) if with_sinks else None
    reshape_and_cache(key, value, (k_cache, v_cache), meta.slot_mapping,
                      (meta.block_idx, meta.block_offset))
    scale = head_dim**-0.5
    out = paged_attention(query, key, value, (k_cache, v_cache), meta, scale, window,
                          softcap=softcap, sinks=sinks)
    start = 0
    for n, c, k, v in zip(query_lens, computed, seqs_k, seqs_v, strict=True):
        want = dense_reference(query[start : start + n], k, v, torch.arange(c, c + n), scale,
                               window, softcap, sinks)
        torch.testing.assert_close(out[start : start + n], want, rtol=1e-4, atol=1e-5)
        start += n


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_model_impl_flag_on_every_engine_command(role) -> None:
    from tandem.services.common.server import build_engine_config, build_parser

    parser = build_parser(f"tandem {role}", None)
    ns = parser.parse_args(["--role", role, "--model-impl", "transformers"]
                           + ([] if role == "both" else ["--redis-url", "redis://x:1/0"]))
    assert build_engine_config(ns, role).model.model_impl == "transformers"
    assert parser.parse_args(["--role", role]).model_impl == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-impl", "vllm"])
