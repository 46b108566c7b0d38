"""The default GGUF (Q4_1) run on its quantized blocks (engine/quantization/gguf.py) against
its copy dequantized at load (quantization="none")."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.quantization import gguf as gguf_method
from tandem.kernels.gguf_linear import GGUFLinear

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "List three colors:"]


def test_gguf_names_map_to_hf_names():
    assert gguf_method.hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_method.hf_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight")
    assert gguf_method.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk\.0\.ssm_a' has no Hugging Face"):
        gguf_method.hf_name("blk.0.ssm_a")


def test_unpermute_undoes_llama_cpp_permute():
    """llama.cpp's convert permute (reshape(n_head, 2, d/2, ...).swapaxes(1, 2)) undone on
    whole rows, as transformers' reverse_permute_weights does."""
    n_head, rows = 4, 32
    w = torch.arange(rows * 3).reshape(rows, 3)
    permuted = w.reshape(n_head, 2, rows // n_head // 2, 3).swapaxes(1, 2).reshape(rows, 3)
    assert torch.equal(gguf_method._unpermute(permuted, n_head), w)


def _on_blocks(model) -> bool:
    return isinstance(model.model.layers[0].self_attn.qkv_proj, gguf_method.GGUFQuantLinear)


@pytest.mark.slow
def test_default_gguf_loads_quantized_when_asked_and_dequantized_in_float32():
    """With quantization="gguf" the default model's projections and tied head stay in their
    Q4_1 / Q8_0 blocks, packed for the integer-dot kernel; in float32, or with
    quantization="none", a .gguf is dequantized at load."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model_loader import load_model

    assert not _on_blocks(load_model(ModelConfig(dtype="float32")).model)
    assert not _on_blocks(load_model(ModelConfig(quantization="none", dtype="bfloat16")).model)
    model = load_model(ModelConfig(quantization="gguf")).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, gguf_method.GGUFQuantLinear) and isinstance(qkv.inner, GGUFLinear)
    assert [p.type_id for p in qkv.inner.parts] == [3, 3, 3]  # Q4_1
    assert qkv.inner.packed is not None and qkv.inner.packed.type_id == 3
    assert isinstance(model.tied_lm_head, GGUFLinear)  # Q8_0 token embedding
    # the lookup dequantizes the rows it reads, exactly as the table dequantized at load
    from tandem.kernels.gguf_linear import GGUFEmbedding

    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    ids = torch.tensor([[0, 1, 7042], [49151, 3, 3]])
    plain = load_model(ModelConfig(quantization="none", dtype="bfloat16")).model
    assert torch.equal(model.model.embed_tokens(ids), plain.model.embed_tokens(ids))
    assert model.tied_lm_head.packed is not None and model.tied_lm_head.packed.type_id == 8


@pytest.mark.slow
def test_default_gguf_runs_on_its_blocks_by_default_in_bf16():
    """Unset quantization in bf16: on the blocks where the integer-dot kernels run (a
    native library with a SIMD path), else dequantized at load."""
    from tandem.engine.config import ModelConfig
    from tandem.engine.model_loader import _dot_kernels_serve, load_model

    model = load_model(ModelConfig(dtype="bfloat16")).model
    assert _on_blocks(model) == _dot_kernels_serve(torch.bfloat16)


def _generate(quantization):
    from tandem.engine.llm import LLM
    from tandem.engine.sampling_params import SamplingParams

    llm = LLM(quantization=quantization, kv_cache_memory=1 << 24)
    sp = SamplingParams(max_tokens=16, temperature=0.0, logprobs=5)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.mark.slow
def test_default_gguf_native_close_to_dequantized():
    """vLLM's rule: at the first position where the greedy tokens differ, each side's token
    is in the other's top-5 logprobs."""
    native = _generate("gguf")
    dense = _generate("none")
    same = 0
    for x, y in zip(native, dense, strict=True):
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if tx != ty:
                assert tx in y.logprobs[i] and ty in x.logprobs[i], (i, x.token_ids, y.token_ids)
                break
            same += 1
    assert same >= len(PROMPTS)  # not a vacuous pass: most first tokens agree



@pytest.mark.slow
def test_first_load_of_a_gguf_without_a_cache_dequantizes(tmp_path, monkeypatch):
    """A fresh machine has no dequantized copy yet: the first load goes through
    transformers, whose config carries a GGUF quantization_config; the dequantized model
    must load (it was refused as an unknown 'quantizationmethod.gguf') and write the cache
    the next load reads."""
    from tandem.engine import model_loader
    from tandem.engine.config import ModelConfig

    monkeypatch.setattr(model_loader, "GGUF_CACHE_DIR", str(tmp_path))
    loaded = model_loader.load_model(ModelConfig(dtype="float32"))
    assert not isinstance(loaded.model.model.layers[0].self_attn.qkv_proj,
                          gguf_method.GGUFQuantLinear)
    assert getattr(loaded.hf_config, "quantization_config", None) is None
    assert len(list(tmp_path.iterdir())) == 1  # the cache written for the next load


def test_quant_method_enum_of_a_transformers_config_is_read_by_its_value():
    """transformers' quantization config classes hold QuantizationMethod members, whose
    str() is 'QuantizationMethod.GPTQ', not the method's name."""
    from types import SimpleNamespace

    from transformers.utils.quantization_config import QuantizationMethod

    from tandem.engine.quantization import resolve_quantization

    cfg = SimpleNamespace(quantization_config={"quant_method": QuantizationMethod.GPTQ,
                                               "bits": 4, "group_size": 128, "sym": True,
                                               "desc_act": False})
    assert resolve_quantization(None, cfg).name == "gptq"
