"""MoE kernels (kernels/moe.py) and the MoE block's parallel split (engine/models/moe.py):
``fused_experts`` against the per-token ``fused_experts_ref``; ``select_experts`` against
each family's own transformers router; the expert split's errors and the EP config check."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import tiny_config

from tandem.engine.config import ParallelConfig
from tandem.engine.models.moe import ExpertShard, MoESpec
from tandem.kernels.moe import ACTIVATIONS, fused_experts, fused_experts_ref, select_experts

H, I, E, K = 64, 32, 8, 2  # noqa: E741 - hidden, intermediate, experts, top-k


def _weights(e: int = E, bias: bool = False, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * I, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, H, I, generator=g) * 0.2).to(dtype)
    b13 = (torch.randn(e, 2 * I, generator=g) * 0.2).to(dtype) if bias else None
    b2 = (torch.randn(e, H, generator=g) * 0.2).to(dtype) if bias else None
    return w13, w2, b13, b2


def _routing(t: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return select_experts(torch.randn(t, E, generator=g), K, renormalize=True)


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_fused_experts_equals_per_token_reference(activation: str, num_tokens: int) -> None:
    bias = activation == "swiglu_oai"
    w13, w2, b13, b2 = _weights(bias=bias)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(num_tokens)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=activation, limit=0.5)
    got = fused_experts(x, w13, w2, weights, ids, **kw)
    want = fused_experts_ref(x, w13, w2, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("routing", ["two-experts-loop", "balanced-bmm"])
def test_both_grouped_paths_equal_the_reference(routing: str) -> None:
    """Few experts hit: the per-expert loop; all hit, balanced: the padded ``bmm``."""
    w13, w2, b13, b2 = _weights(bias=True)
    t = 24
    if routing == "two-experts-loop":
        ids = torch.tensor([[0, 1]] * t)
    else:
        ids = torch.arange(t * K).remainder(E).view(t, K)
    weights = torch.rand(t, K, generator=torch.Generator().manual_seed(4))
    x = torch.randn(t, H)
    for act in ACTIVATIONS:
        kw = dict(w13_bias=b13, w2_bias=b2, activation=act)
        torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids, **kw),
                                   fused_experts_ref(x, w13, w2, weights, ids, **kw),
                                   rtol=1e-5, atol=1e-5)


def test_fused_experts_bf16_close_to_reference() -> None:
    w13, w2, _, _ = _weights(dtype=torch.bfloat16)
    x = torch.randn(33, H).to(torch.bfloat16)
    weights, ids = _routing(33)
    got = fused_experts(x, w13, w2, weights, ids)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)


def test_expert_parallel_shares_sum_to_the_whole() -> None:
    """Two ranks with half the experts each: their partial sums add up to one rank's."""
    w13, w2, b13, b2 = _weights(bias=True)
    x = torch.randn(20, H)
    weights, ids = _routing(20)
    kw = dict(activation="swiglu_oai")
    whole = fused_experts(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, **kw)
    half = E // 2
    parts = [fused_experts(x, w13[r * half:(r + 1) * half], w2[r * half:(r + 1) * half],
                           weights, ids, w13_bias=b13[r * half:(r + 1) * half],
                           w2_bias=b2[r * half:(r + 1) * half], expert_start=r * half, **kw)
             for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_fused_experts_rejects_shapes_and_activation() -> None:
    w13, w2, _, _ = _weights()
    weights, ids = _routing(3)
    with pytest.raises(ValueError, match="shapes do not fit"):
        fused_experts(torch.randn(3, H + 1), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="activation"):
        fused_experts(torch.randn(3, H), w13, w2, weights, ids, activation="gelu")


def _hf_router(module: str, cls: str, config) -> torch.nn.Module:
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[cls])
    torch.manual_seed(5)
    router = getattr(mod, cls)(config)
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(0.0, 0.5)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0.0, 0.1)
    return router


def _config(arch: str, **extra):
    return tiny_config(arch, vocab=256, hidden=H, ffn=I, **extra)


ROUTERS = {
    "qwen3-moe": ("qwen3_moe", "Qwen3MoeTopKRouter",
                  lambda: _config("Qwen3MoeForCausalLM", num_experts=E, num_experts_per_tok=K,
                                  norm_topk_prob=False, moe_intermediate_size=I)),
    "qwen3-moe-norm": ("qwen3_moe", "Qwen3MoeTopKRouter",
                       lambda: _config("Qwen3MoeForCausalLM", num_experts=E,
                                       num_experts_per_tok=K, norm_topk_prob=True,
                                       moe_intermediate_size=I)),
    "qwen2-moe": ("qwen2_moe", "Qwen2MoeTopKRouter",
                  lambda: _config("Qwen2MoeForCausalLM", num_experts=E, num_experts_per_tok=K,
                                  moe_intermediate_size=I)),
    "mixtral": ("mixtral", "MixtralTopKRouter",
                lambda: _config("MixtralForCausalLM", num_local_experts=E, num_experts_per_tok=K)),
    "gpt-oss": ("gpt_oss", "GptOssTopKRouter",
                lambda: _config("GptOssForCausalLM", num_local_experts=E, num_experts_per_tok=K)),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3TopkRouter",
                    lambda: _config("DeepseekV3ForCausalLM", n_routed_experts=E,
                                    num_experts_per_tok=K, moe_intermediate_size=I, n_group=4,
                                    topk_group=2, routed_scaling_factor=2.5)),
    "deepseek-v2-group": ("deepseek_v2", "DeepseekV2TopkRouter",
                          lambda: _config("DeepseekV2ForCausalLM", n_routed_experts=E,
                                          num_experts_per_tok=K, moe_intermediate_size=I,
                                          n_group=4, topk_group=2,
                                          topk_method="group_limited_greedy",
                                          routed_scaling_factor=1.5)),
    "deepseek-v2-greedy": ("deepseek_v2", "DeepseekV2TopkRouter",
                           lambda: _config("DeepseekV2ForCausalLM", n_routed_experts=E,
                                           num_experts_per_tok=K, moe_intermediate_size=I,
                                           topk_method="greedy")),
}


def _spec(name: str, config) -> MoESpec:
    if name.startswith("qwen"):
        return MoESpec.qwen_moe(config)
    if name == "mixtral":
        return MoESpec.mixtral(config)
    if name == "gpt-oss":
        return MoESpec.gpt_oss(config)
    return MoESpec.deepseek(config)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_routing_equals_transformers_router(name: str) -> None:
    module, cls, make = ROUTERS[name]
    config = make()
    router = _hf_router(module, cls, config)
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, hf_w, hf_ids = router(x)
    s = _spec(name, config)
    logits = torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None))
    bias = getattr(router, "e_score_correction_bias", None) if s.correction_bias else None
    w, ids = select_experts(
        logits, s.top_k, scoring=s.scoring, renormalize=s.renormalize,
        softmax_after_topk=s.softmax_after_topk, n_group=s.n_group, topk_group=s.topk_group,
        group_score=s.group_score, correction_bias=bias,
        routed_scaling_factor=s.routed_scaling_factor)
    # The order of a token's k experts is unspecified on both sides: compare sorted by id.
    hf_ids, order = hf_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w.gather(1, mine).float(), hf_w.gather(1, order).float(),
                               rtol=1e-5, atol=1e-6)


def test_expert_parallel_split_and_its_errors() -> None:
    part = ExpertShard.of(8, 32, 1, 2, expert_parallel=True)
    assert (part.start, part.stop, part.intermediate_size, part.offset) == (4, 8, 32, 0)
    tp = ExpertShard.of(8, 32, 1, 2, expert_parallel=False)
    assert (tp.start, tp.stop, tp.intermediate_size, tp.offset) == (0, 8, 16, 16)
    with pytest.raises(ValueError, match="enable_expert_parallel: num_experts 6 must be divis"):
        ExpertShard.of(6, 32, 0, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        ExpertShard.of(8, 32, 0, 3, expert_parallel=False)
    with pytest.raises(ValueError, match="enable_expert_parallel needs tensor_parallel_size"):
        ParallelConfig(enable_expert_parallel=True)
    assert ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).world_size == 2


def test_select_experts_errors() -> None:
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.randn(2, E), E + 1)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(torch.randn(2, E), K, scoring="relu")
    with pytest.raises(ValueError, match="divisible by n_group"):
        select_experts(torch.randn(2, E), K, n_group=3, topk_group=1)


def test_checkpoint_tensor_errors_name_the_tensor() -> None:
    from tandem.engine.models.registry import build_model

    config = _config("Qwen3MoeForCausalLM", num_experts=E, num_experts_per_tok=K,
                     moe_intermediate_size=I)
    hf = transformers.Qwen3MoeForCausalLM(config)
    sd = dict(hf.state_dict())
    sd["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(E, 2 * I, H + 1)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.experts.gate_up_proj'.*shape"):
        build_model(config, sd, torch.float32, "cpu", 64)
    sd = dict(hf.state_dict())
    del sd["model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(ValueError, match=r"missing.*model.layers.0.mlp.experts.w2"):
        build_model(config, sd, torch.float32, "cpu", 64)
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(I, H)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.9.up_proj.weight'.*range"):
        build_model(config, sd, torch.float32, "cpu", 64)


def test_block_reads_the_engine_expert_parallel_flag(monkeypatch) -> None:
    """``init_distributed(enable_expert_parallel=True)`` reaches every sparse block."""
    from tandem.engine import distributed
    from tandem.engine.models.moe import SparseMoeBlock
    from tandem.engine.models.sharding import ModelShard

    config = _config("Qwen3MoeForCausalLM", num_experts=E, num_experts_per_tok=K,
                     moe_intermediate_size=I)
    shard = ModelShard.of(config, 1, 2, 0, 1)
    with torch.device("meta"):
        assert SparseMoeBlock(config, shard, MoESpec.qwen_moe(config)).experts.w13.shape == (
            E, I, H)
        monkeypatch.setattr(distributed, "_EXPERT_PARALLEL", True)
        block = SparseMoeBlock(config, shard, MoESpec.qwen_moe(config))
    assert (block.part.start, block.part.stop) == (E // 2, E)
    assert block.experts.w13.shape == (E // 2, 2 * I, H)
