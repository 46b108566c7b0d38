"""Quantized checkpoints (issue 38): GPTQ, AWQ and compressed-tensors checkpoints of a tiny
Llama written by ``tests/quant_checkpoints.py`` from each format's documented packing,
loaded by ``LLM(model=folder)`` with the method detected from ``quantization_config``,
against the same model with the dequantized weights (vLLM's closeness rule); on-load
int8 / int4; unpacking exact against the spec packers; bad inputs refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from quant_checkpoints import (
    pack_lsb_first,
    quantize_awq,
    quantize_ct_int8,
    quantize_ct_packed,
    quantize_fp8,
    quantize_gptq,
    unpack_lsb_first,
    write_plain,
    write_quantized,
)
from safetensors.torch import load_file, save_file
from tiny_models import tiny_config, tiny_hf_model

from tandem.engine.config import QUANTIZATION_CHOICES, ModelConfig
from tandem.engine.llm import LLM
from tandem.engine.quantization import QUANTIZATION_METHODS
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels.quant.packing import awq_pack, awq_unpack, pack_int32, unpack_int32

PROMPTS = [[1, 5, 9, 33, 7], [4, 100, 17]]


@pytest.fixture(scope="module")
def hf():
    cfg = tiny_config("LlamaForCausalLM", vocab=256, hidden=128, ffn=256, heads=4, kv_heads=2,
                      layers=2, special_tokens=False)
    return tiny_hf_model(cfg, std=0.05)


def _run(folder: str, dtype: str = "float32", quantization: str | None = None):
    llm = LLM(model=folder, dtype=dtype, kv_cache_memory=1 << 20, quantization=quantization)
    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    return [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def assert_close(a, b) -> None:
    """vLLM's rule: at the first position where the greedy tokens differ, each side's token
    is in the other's top-5 logprobs."""
    for x, y in zip(a, b, strict=True):
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if tx != ty:
                assert tx in y.logprobs[i] and ty in x.logprobs[i], (i, x.token_ids, y.token_ids)
                break


def _logprob(out, i):
    lp = out.logprobs[i][out.token_ids[i]]
    return float(getattr(lp, "logprob", lp))


FORMATS = {
    "gptq4-g32-actorder-asym": ({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                 "desc_act": True, "sym": False},
                                lambda w: quantize_gptq(w, 4, 32, act_order=True, sym=False)),
    "gptq8-g-1-sym": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True},
                      lambda w: quantize_gptq(w, 8, -1)),
    "gptq4-v2": ({"quant_method": "gptq", "bits": 4, "group_size": 64,
                  "checkpoint_format": "gptq_v2"}, lambda w: quantize_gptq(w, 4, 64, v1=False)),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
             "version": "gemm"}, lambda w: quantize_awq(w, 32)),
    "ct-w4a16": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                      "group_size": 32}}}, "ignore": ["lm_head"]},
                 lambda w: quantize_ct_packed(w, 4, 32)),
    "ct-w8a16-asym-channel": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                               "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                   "num_bits": 8, "type": "int", "symmetric": False,
                                   "strategy": "channel"}}}},
                              lambda w: quantize_ct_packed(w, 8, None, sym=False)),
    "ct-w4a16-asym": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"g": {"targets": ["Linear"], "weights": {
                           "num_bits": 4, "type": "int", "symmetric": False,
                           "strategy": "group", "group_size": 64}}}},
                      lambda w: quantize_ct_packed(w, 4, 64, sym=False)),
    "ct-w8a8": ({"quant_method": "compressed-tensors", "format": "int-quantized",
                 "config_groups": {"g": {"targets": ["Linear"], "weights": {
                     "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                     "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                           "dynamic": True, "strategy": "token"}}}},
                quantize_ct_int8),
    "ct-fp8-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                        "config_groups": {"g": {"targets": ["Linear"], "weights": {
                            "num_bits": 8, "type": "float", "strategy": "channel"}}}},
                       lambda w: quantize_fp8(w, True)),
    "ct-fp8-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                       "config_groups": {"g": {"targets": ["Linear"], "weights": {
                           "num_bits": 8, "type": "float", "strategy": "tensor"}}}},
                      lambda w: quantize_fp8(w, False)),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_checkpoint_close_to_dequantized(hf, tmp_path, fmt) -> None:
    qcfg, quantize = FORMATS[fmt]
    ref = write_quantized(hf, str(tmp_path / "q"), qcfg, quantize)
    write_plain(hf, str(tmp_path / "ref"), ref)
    got, want = _run(str(tmp_path / "q")), _run(str(tmp_path / "ref"))
    assert_close(got, want)
    if fmt != "ct-w8a8":  # weight-only: the same weights, float32 either way
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert abs(_logprob(got[0], 0) - _logprob(want[0], 0)) < 1e-3


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_load_close_to_unquantized(hf, tmp_path, method) -> None:
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    write_plain(hf, str(tmp_path / "m"), state)
    assert_close(_run(str(tmp_path / "m"), "bfloat16", method),
                 _run(str(tmp_path / "m"), "bfloat16"))


def test_weight_bytes_reported_are_the_quantized_ones(hf, tmp_path) -> None:
    """The engine's facts (start-up log, ``tandem:model_weight_bytes``) count the weights
    as they sit in memory: on-load int8 and int4 hold fewer bytes than bf16."""
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    write_plain(hf, str(tmp_path / "m"), state)

    def facts_bytes(quantization):
        llm = LLM(model=str(tmp_path / "m"), dtype="bfloat16", kv_cache_memory=1 << 20,
                  quantization=quantization)
        return llm.llm_engine.engine_core.model_facts.weight_bytes

    bf16, int8, int4 = facts_bytes(None), facts_bytes("int8"), facts_bytes("int4")
    assert 0 < int4 < int8 < bf16


def test_packing_matches_the_spec() -> None:
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        v = torch.randint(0, 1 << bits, (64, 32), generator=g)
        for dim in (0, 1):
            packed = pack_lsb_first(v, bits, dim)
            assert torch.equal(pack_int32(v, bits, dim), packed)
            assert torch.equal(unpack_int32(packed, bits, dim).long(), v)
            assert torch.equal(unpack_lsb_first(packed, bits, dim), v)
    v = torch.randint(0, 16, (8, 32), generator=g)
    assert torch.equal(awq_unpack(awq_pack(v)).long(), v)
    from quant_checkpoints import _awq_pack
    assert torch.equal(awq_pack(v), _awq_pack(v))


def test_methods_registry_matches_config_choices() -> None:
    assert tuple(QUANTIZATION_METHODS) == QUANTIZATION_CHOICES
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="nf4")


def _gptq_folder(hf, tmp_path, **qcfg):
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, **qcfg}
    folder = str(tmp_path / "q")
    write_quantized(hf, folder, cfg, lambda w: quantize_gptq(w, 4, 32, act_order=True))
    return folder


def _edit(folder: str, fn) -> None:
    path = os.path.join(folder, "model.safetensors")
    t = load_file(path)
    fn(t)
    save_file(t, path)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.scales",
                             t["model.layers.0.self_attn.q_proj.scales"][:, :64].contiguous()),
     r"'model.layers.0.self_attn.q_proj.scales' has shape \(4, 64\)"),
    (lambda t: t.__setitem__("model.layers.1.mlp.down_proj.qweight",
                             t["model.layers.1.mlp.down_proj.qweight"][:8].contiguous()),
     "'model.layers.1.mlp.down_proj.qweight' has shape"),
    (lambda t: t.__setitem__("model.layers.0.mlp.down_proj.g_idx",
                             torch.zeros_like(t["model.layers.0.mlp.down_proj.g_idx"])),
     "model.layers.0.mlp.down_proj.g_idx.*group size 32"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.g_idx",
                             t["model.layers.0.self_attn.k_proj.g_idx"].flip(0).contiguous()),
     "g_idx' differs from the other parts"),
])
def test_corrupted_tensors_are_named(hf, tmp_path, edit, match) -> None:
    folder = _gptq_folder(hf, tmp_path)
    _edit(folder, edit)
    with pytest.raises(ValueError, match=match):
        LLM(model=folder, dtype="float32", kv_cache_memory=1 << 20)


@pytest.mark.parametrize("qcfg, requested, match", [
    ({"quant_method": "gptq", "bits": 3}, None, "gptq: bits 3 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, None, "group_size 48 does not divide"),
    ({"quant_method": "awq", "version": "gemv"}, None, "version 'gemv' is not supported"),
    ({"quant_method": "bitsandbytes"}, None, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "awq", "'awq' was asked for.*quantized with 'gptq'"),
    ({"quant_method": "gptq", "bits": 4}, "int8", "'int8' was asked for.*quantized with 'gptq'"),
])
def test_unsupported_settings_fail_at_start(hf, tmp_path, qcfg, requested, match) -> None:
    folder = _gptq_folder(hf, tmp_path)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=match):
        LLM(model=folder, dtype="float32", kv_cache_memory=1 << 20, quantization=requested)


def test_checkpoint_method_needs_a_quantized_checkpoint(hf, tmp_path) -> None:
    write_plain(hf, str(tmp_path / "m"), {k: v.float() for k, v in hf.state_dict().items()})
    with pytest.raises(ValueError, match="'gptq' needs a checkpoint quantized with it"):
        LLM(model=str(tmp_path / "m"), quantization="gptq", kv_cache_memory=1 << 20)
