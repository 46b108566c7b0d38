"""The Transformers backend's fused projections (``transformers_fusion``) on whole tiny
models: q/k/v and gate/up of every layer are one GEMM each, and the float32 greedy
tokens still equal transformers' own ``generate``."""

from __future__ import annotations

import pytest
import torch
from test_llm_tiny_models import assert_matches_hf
from tiny_models import hf_greedy_steps, tiny_config, tiny_hf_model

from tandem import LLM, SamplingParams
from tandem.engine.models.transformers_fusion import FusedProjection

VOCAB = 256
NEW_TOKENS = 8

#: a Llama; Qwen2 (q/k/v with biases); Granite (residual, attention, logit multipliers)
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "GraniteForCausalLM"]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_give_transformers_greedy_tokens(arch: str, tmp_path) -> None:
    config = tiny_config(arch, vocab=VOCAB, hidden=64, ffn=128, max_len=128,
                         special_tokens=False)
    hf = tiny_hf_model(config, std=0.2, seed=11)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, block_size=4,
              max_num_batched_tokens=16, model_impl="transformers")
    model = llm.llm_engine.engine_core.executor.driver_worker.model_runner.model.hf
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.fused_q_k_v, FusedProjection)
        assert isinstance(mlp.fused_gate_up, FusedProjection)
        assert attn.q_proj._fused is attn.fused_q_k_v
        assert mlp.up_proj._fused is mlp.fused_gate_up
    assert not any(type(m) is torch.nn.Linear for n, m in model.named_modules()
                   if n.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 5, 23, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
                        use_tqdm=False)
    assert len({t for o in outs for t in o.outputs[0].token_ids}) >= 8
    for prompt, out in zip(prompts, outs, strict=True):
        ref, logits = hf_greedy_steps(hf, prompt, NEW_TOKENS)
        assert_matches_hf(list(out.outputs[0].token_ids), ref, logits)
