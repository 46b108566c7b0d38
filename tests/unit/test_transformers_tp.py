"""Tensor parallelism of the Transformers modeling backend (``transformers_tp.py``) in one
process: the refusals (no plan, a style it does not serve, heads that do not split), and
one rank's split of a tiny model under a stand-in TP group of two whose all-reduce
returns its input, so each rank's partial sums can be added here. The TP=2 token checks
against transformers run in ``tests/e2e/test_transformers_backend_tp.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from tiny_models import tiny_config, tiny_hf_model

from tandem.engine import distributed
from tandem.engine.models import transformers_backend, transformers_tp
from tandem.engine.models.registry import build_model


class Group:
    """A TP group of ``world_size`` seen from ``rank_in_group``; all-reduce returns its
    input (each rank's output is then its partial sum plus the bias)."""

    def __init__(self, world_size: int, rank_in_group: int = 0) -> None:
        self.world_size, self.rank_in_group = world_size, rank_in_group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def as_rank(monkeypatch, tp: int, rank: int = 0) -> None:
    monkeypatch.setattr(distributed, "get_tp_group", lambda: Group(tp, rank))


def config(arch: str, heads: int = 4, kv_heads: int = 2, hidden: int = 32,
           **extra) -> transformers.PretrainedConfig:
    return tiny_config(arch, vocab=64, hidden=hidden, ffn=64, heads=heads, kv_heads=kv_heads,
                       max_len=64, special_tokens=False, **extra)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        # StableLM's config declares no plan
        (config("StableLmForCausalLM"), "StableLmForCausalLM declares no tensor-parallel plan"),
        # Phi-3's fused qkv_proj: the plan gathers its output
        (config("Phi3ForCausalLM"), "Phi3ForCausalLM's .* style 'colwise_gather_output'"),
        (config("Olmo2ForCausalLM"), "style 'colwise_gather_output'"),
        # GPT-OSS's plan splits only the embedding
        (config("GptOssForCausalLM", head_dim=8, num_local_experts=2),
         "GptOssForCausalLM's tensor-parallel plan splits no module"),
        (config("LlamaForCausalLM", heads=3, kv_heads=1, hidden=48),
         "must divide num_attention_heads 3 and num_key_value_heads 1 .LlamaForCausalLM"),
        (config("LlamaForCausalLM", heads=4, kv_heads=1),
         "must divide num_attention_heads 4 and num_key_value_heads 1"),
    ],
    ids=["no-plan", "gather-output", "olmo2", "splits-nothing", "heads", "kv-heads"],
)
def test_refused_naming_tensor_parallel_size(monkeypatch, cfg, match) -> None:
    as_rank(monkeypatch, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2") as err:
        transformers_backend.TransformersForCausalLM(cfg, max_position=64)
    assert err.match(match)


def test_moe_and_mla_styles_are_refused_by_name() -> None:
    plan = {"layers.*.mlp.experts.gate_up_proj": "local_colwise", "layers.*.mlp.gate": "ep_router"}
    cfg = config("Qwen3MoeForCausalLM", num_experts=2, moe_intermediate_size=16)
    cfg.base_model_tp_plan = plan
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM's .* style 'local_colwise'"):
        transformers_tp.check_tp_plan(cfg, "Qwen3MoeForCausalLM", 2)
    with pytest.raises(ValueError, match="style 'mla_kv_a_proj'"):
        transformers_tp.check_tp_plan(transformers.DeepseekV3Config(), "DeepseekV3ForCausalLM", 2)


def test_pipeline_parallel_still_refused(monkeypatch) -> None:
    as_rank(monkeypatch, 2)
    monkeypatch.setattr(distributed, "get_pp_group", lambda: Group(2))
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        transformers_backend.TransformersForCausalLM(config("LlamaForCausalLM"), max_position=64)


def test_a_plan_that_splits_a_non_linear_module_is_refused() -> None:
    hf = tiny_hf_model(config("LlamaForCausalLM"), seed=0)
    cfg = copy.deepcopy(hf.config)
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "layers.*.input_layernorm": "colwise"}
    with pytest.raises(ValueError, match="splits layers.0.input_layernorm .LlamaRMSNorm"):
        transformers_tp.shard_base_model(hf.base_model, cfg, "LlamaForCausalLM", 0, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_one_ranks_model_holds_its_heads(monkeypatch, rank) -> None:
    """Rank ``rank`` of 2 on a Llama of 4 query / 2 KV heads: 2 query heads and KV head
    ``rank``, q/k/v split by rows, o/down by columns; the LM head stays whole and only
    rank 0 computes logits."""
    hf = tiny_hf_model(config("LlamaForCausalLM"), std=0.2, seed=3)
    as_rank(monkeypatch, 2, rank)
    model = build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 64, "transformers")
    shard = model.shard
    assert (shard.tp_rank, shard.tp_size, shard.num_heads) == (rank, 2, 2)
    assert shard.kv_heads == range(rank, rank + 1)
    attn = model.hf.model.layers[1].self_attn
    head_dim = 8
    full = hf.model.layers[1].self_attn
    torch.testing.assert_close(attn.q_proj.weight,
                               full.q_proj.weight[rank * 16:(rank + 1) * 16], rtol=0, atol=0)
    torch.testing.assert_close(attn.k_proj.weight,
                               full.k_proj.weight[rank * head_dim:(rank + 1) * head_dim],
                               rtol=0, atol=0)
    assert attn.o_proj.weight.shape == (32, 16)
    assert model.hf.model.layers[0].mlp.down_proj.weight.shape == (32, 32)
    assert model.hf.lm_head.weight.shape == (64, 32)
    logits = model.compute_logits(torch.zeros(1, 32))
    assert (logits is None) == (rank == 1)
    # the engine's facts stay the whole model's
    assert model.config.num_key_value_heads == 2


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Starcoder2ForCausalLM", "GPTNeoXForCausalLM"])
def test_rank_outputs_add_up_to_the_whole_layer(arch) -> None:
    """Every decoder layer's MLP (colwise then rowwise, with biases where the model has
    them), split over two ranks: the ranks' partial sums plus the bias once equal the
    unsplit MLP (the all-reduce here returns its input)."""
    cfg = config(arch, kv_heads=4 if arch == "GPTNeoXForCausalLM" else 2)
    hf = tiny_hf_model(cfg, std=0.2, seed=5)
    ranks = [copy.deepcopy(hf) for _ in range(2)]
    split = [transformers_tp.shard_base_model(m.base_model, cfg, arch, r, 2)
             for r, m in enumerate(ranks)]
    plan = cfg.base_model_tp_plan
    num_split = sum(s in transformers_tp.SHARDED_STYLES for s in plan.values())
    assert split[0] == split[1] and len(split[0]) == cfg.num_hidden_layers * num_split
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    for layer, *parts in zip(hf.base_model.layers, *(m.base_model.layers for m in ranks),
                             strict=True):
        rowwise = [n for n, s in plan.items()
                   if s == "rowwise" and ".mlp." in n][0].rsplit(".", 1)[1]
        bias = getattr(getattr(layer.mlp, rowwise), "bias", None)
        with torch.no_grad():
            want = layer.mlp(x)
            got = sum(p.mlp(x) for p in parts)
        if bias is not None:
            got = got - bias
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_module_the_plan_keeps_whole_that_sees_split_heads_is_refused(monkeypatch) -> None:
    """Cohere's q/k LayerNorms hold a weight per head of the whole model and the plan
    does not split them: the split model fails its load-time probe, refused naming
    ``tensor_parallel_size`` (never silently different numbers)."""
    hf = tiny_hf_model(config("CohereForCausalLM", use_qk_norm=True), std=0.2, seed=4)
    as_rank(monkeypatch, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: CohereForCausalLM split by"):
        build_model(hf.config, hf.state_dict(), torch.float32, "cpu", 64, "transformers")
