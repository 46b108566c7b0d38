"""The KV cache spec (per-head K/V or MLA's latent) from the config to the layout's
fingerprint, the allocation and the sharded view; MLA's rotary tables and softmax scale
against transformers' own functions."""

from __future__ import annotations

import hashlib

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb_interleave,
)

from tandem.contracts.kv_layout import FINGERPRINT_BYTES, KVCacheLayout, KVCacheSpec
from tandem.engine.kv_shards import KVShard, ShardedKVCache
from tandem.engine.model_facts import ModelFacts, kv_cache_spec, resolve_model_facts
from tandem.engine.models.mla import (
    MLARotary,
    mla_rope_params,
    mla_softmax_scale,
    rotate_interleaved,
)
from tandem.kernels.cache import (
    allocate_kv_cache,
    kv_cache_bytes_per_block,
    kv_cache_layer_views,
)

COMMON = dict(model_id="m", num_layers=3, dtype="bfloat16", block_size=16)


def deepseek_v3(**kw: object) -> transformers.DeepseekV3Config:
    base: dict[str, object] = dict(
        vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, max_position_embeddings=512, architectures=["DeepseekV3ForCausalLM"])
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1}


def test_mha_fingerprint_is_the_string_it_always_was() -> None:
    layout = KVCacheLayout(num_kv_heads=2, head_dim=64, **COMMON)  # type: ignore[arg-type]
    canon = "model_id=m|num_layers=3|num_kv_heads=2|head_dim=64|dtype=bfloat16|block_size=16"
    assert layout.fingerprint == hashlib.sha256(canon.encode()).digest()[:FINGERPRINT_BYTES]
    assert layout.block_shape == (3, 2, 16, 2, 64)
    assert layout.spec == KVCacheSpec.mha(2, 64)


def test_mla_layout_is_the_latent_and_names_its_kind() -> None:
    mla = KVCacheLayout.of_spec(KVCacheSpec.mla(512, 64), **COMMON)  # type: ignore[arg-type]
    assert (mla.kind, mla.num_kv_heads, mla.head_dim, mla.rope_dim) == ("mla", 1, 576, 64)
    assert mla.block_shape == (3, 1, 16, 1, 576)
    assert mla.block_bytes == 3 * 16 * 576 * 2
    # No per-head K/V geometry has its fingerprint, the one of its bytes per block included.
    for heads, dim in [(1, 576), (1, 288), (2, 144), (4, 72), (128, 192)]:
        mha = KVCacheLayout.of_spec(KVCacheSpec.mha(heads, dim), **COMMON)  # type: ignore[arg-type]
        assert mha.fingerprint != mla.fingerprint
    other_split = KVCacheLayout.of_spec(KVCacheSpec.mla(448, 128), **COMMON)  # type: ignore[arg-type]
    assert other_split.block_bytes == mla.block_bytes
    assert other_split.fingerprint != mla.fingerprint


@pytest.mark.parametrize("kwargs, field", [
    ({"kind": "gqa", "num_kv_heads": 1, "head_dim": 8}, "kind"),
    ({"kind": "mla", "num_kv_heads": 2, "head_dim": 8, "rope_dim": 4}, "num_kv_heads"),
    ({"kind": "mla", "num_kv_heads": 1, "head_dim": 8, "rope_dim": 8}, "rope_dim"),
    ({"kind": "mha", "num_kv_heads": 1, "head_dim": 8, "rope_dim": 4}, "rope_dim"),
    ({"kind": "mha", "num_kv_heads": 0, "head_dim": 8}, "num_kv_heads"),
])
def test_bad_specs_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVCacheSpec(**kwargs)
    with pytest.raises(ValueError, match=field):
        KVCacheLayout(model_id="m", num_layers=1, dtype="float32", block_size=4, **kwargs)


def test_config_to_spec_to_facts() -> None:
    cfg = deepseek_v3()
    assert kv_cache_spec(cfg, "tandem") == KVCacheSpec.mla(32, 8)
    # transformers' attention sees K/V expanded to every head
    assert kv_cache_spec(cfg, "transformers").kind == "mha"
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2)
    assert kv_cache_spec(llama, "tandem") == KVCacheSpec.mha(2, 16)
    facts = resolve_model_facts(cfg, None, model_id="m", eos_token_id=None, dtype="torch.float32",
                                device="cpu")
    assert (facts.num_kv_heads, facts.head_dim, facts.kv_kind, facts.kv_rope_dim) == (
        1, 40, "mla", 8)
    assert facts.kv_spec == KVCacheSpec.mla(32, 8)
    with pytest.raises(ValueError, match="rope_dim"):
        ModelFacts(model_id="m", vocab_size=1, max_model_len=1, eos_token_id=None, num_layers=1,
                   num_kv_heads=1, head_dim=8, dtype="float32", device="cpu", kv_kind="mla")


def test_one_component_cache_allocation_views_and_shards() -> None:
    kv = allocate_kv_cache(5, 3, 4, 1, 40, torch.float32, num_components=1)
    assert kv.shape == (5, 3, 1, 4, 1, 40)
    assert kv_cache_bytes_per_block(3, 4, 1, 40, torch.float32, 1) == kv[0].numel() * 4
    assert kv_cache_bytes_per_block(3, 4, 2, 8, torch.float32) == 3 * 2 * 4 * 2 * 8 * 4
    views = kv_cache_layer_views(kv)
    assert len(views) == 3 and all(k is not v and k.data_ptr() == v.data_ptr() for k, v in views)
    mha = allocate_kv_cache(2, 3, 4, 2, 8, torch.float32)
    k, v = kv_cache_layer_views(mha)[1]
    assert k.data_ptr() == mha[:, 1, 0].data_ptr() and v.data_ptr() == mha[:, 1, 1].data_ptr()
    with pytest.raises(ValueError, match="num_components"):
        allocate_kv_cache(1, 1, 4, 1, 8, torch.float32, num_components=3)
    # The store's sharded view: a latent block round-trips, and shards must agree.
    kv.copy_(torch.randn(kv.shape))
    sharded = ShardedKVCache.from_tensor(kv)
    assert sharded.block_shape == (3, 1, 4, 1, 40) and sharded.block_bytes == 3 * 4 * 40 * 4
    out = torch.empty(2, *sharded.block_shape)
    sharded.read_blocks([4, 1], out)
    assert torch.equal(out[0], kv[4]) and torch.equal(out[1], kv[1])
    two_parts = ShardedKVCache([KVShard(kv[:, :2].contiguous(), range(2), range(1)),
                                KVShard(kv[:, 2:].contiguous(), range(2, 3), range(1))])
    two_parts.write_blocks([0], out[:1])
    assert torch.equal(two_parts.shards[1].tensor[0], kv[4, 2:])
    with pytest.raises(ValueError, match="components"):
        ShardedKVCache([KVShard(kv[:, :2], range(2), range(1)),
                        KVShard(torch.zeros(5, 1, 2, 4, 1, 40), range(2, 3), range(1))])


@pytest.mark.parametrize("rope", [None, YARN, {**YARN, "mscale": 1.0, "factor": 4.0},
                                  {**YARN, "mscale": None, "mscale_all_dim": None}])
def test_rope_tables_and_softmax_scale_equal_transformers(rope: dict | None) -> None:
    cfg = deepseek_v3(rope_parameters=rope) if rope else deepseek_v3()
    inv_freq, factor = mla_rope_params(cfg)
    rope_type = cfg.rope_parameters["rope_type"]
    init = ROPE_INIT_FUNCTIONS[rope_type] if rope_type != "default" else (
        transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding
        .compute_default_rope_parameters)
    want_inv, want_factor = init(cfg)
    assert torch.equal(inv_freq, want_inv) and factor == pytest.approx(want_factor, rel=1e-12)
    want_scale = yarn_apply_mscale(cfg.rope_parameters, 24 ** -0.5)
    assert mla_softmax_scale(cfg) == pytest.approx(want_scale, rel=1e-12)
    if rope and rope.get("mscale_all_dim"):
        assert mla_softmax_scale(cfg) != pytest.approx(24 ** -0.5)


def test_unsupported_rope_type_is_named() -> None:
    cfg = deepseek_v3(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="'linear'"):
        MLARotary(cfg, 16)


def test_interleaved_rotary_equals_deepseek_v3_and_v2_forms() -> None:
    """V3's de-interleaved output bit for bit; V2's interleaved (complex) output is a
    permutation of it, so ``q_pe . k_pe`` is the same."""
    cfg = deepseek_v3(rope_parameters=YARN)
    rot = MLARotary(cfg, 64)
    pos = torch.tensor([0, 5, 63])
    cos, sin = rot.cos_sin(pos)  # [T, 1, 4]
    q, k = torch.randn(3, 4, 8), torch.randn(3, 1, 8)

    def hf(x: torch.Tensor) -> torch.Tensor:  # ours [T, H, D] -> transformers' [1, H, T, D]
        return x.transpose(0, 1)[None]

    hf_cos, hf_sin = torch.cat((cos, cos), -1)[:, 0][None], torch.cat((sin, sin), -1)[:, 0][None]
    want_q, want_k = apply_rotary_pos_emb_interleave(hf(q), hf(k), hf_cos, hf_sin)
    assert torch.equal(hf(rotate_interleaved(q, cos, sin)), want_q)
    assert torch.equal(hf(rotate_interleaved(k, cos, sin)), want_k)
    # V2: polar(1, freqs) * attention_factor is complex(cos, sin) of our (scaled) tables
    v2_q, v2_k = apply_rotary_emb(hf(q), hf(k), torch.complex(cos[:, 0], sin[:, 0])[None])
    ours = (rotate_interleaved(q, cos, sin) * rotate_interleaved(k, cos, sin)).sum(-1)
    torch.testing.assert_close(hf(ours[..., None])[..., 0], (v2_q * v2_k).sum(-1))
    assert not torch.equal(hf(rotate_interleaved(q, cos, sin)), v2_q)  # a permutation of it
