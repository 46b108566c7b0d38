"""The one-call decode path (kernels/fused_decode.py) against the per-op path.

Both run the same kernels with the same roundings, so a decode step's hidden
states and the K/V it writes must be bit-identical, for every supported
architecture variant (qkv bias, sliding window, tied or untied head), batch
sizes off the 16-row tile grid, and contexts spanning several blocks.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_config, tiny_hf_model
from torch import nn

from tandem.engine.models.registry import build_model
from tandem.engine.quantization import finish_model
from tandem.engine.quantization.dense_linear import Int8Linear
from tandem.engine.quantization.grouped_linear import Int4Linear
from tandem.engine.quantization.methods import Int4OnLoad, Int8OnLoad
from tandem.kernels.attention import build_attention_metadata
from tandem.kernels.cache import allocate_kv_cache
from tandem.kernels.fused_decode import FusedDecode
from tandem.kernels.gguf_linear import GGUFLinear, QuantizedPart
from tandem.kernels.linear import pack_linear_layers

# every variant with the AVX512-BF16 kernels (conftest's bf16_variant)
pytestmark = pytest.mark.usefixtures("bf16_variant")

#: architecture -> its config's extra settings
ARCHS = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": 12},
    "Qwen2ForCausalLM": {},
}
BLOCK = 16


class _GGUFProjection(nn.Module):
    """A decoder projection on Q4_1 blocks quantized from a linear's weight (as a .gguf's
    ``GGUFQuantLinear``: the kernel reads ``inner``)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        import gguf

        w = linear.weight.detach().float().numpy()
        raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1))
        bias = None if linear.bias is None else linear.bias.detach()
        self.inner = GGUFLinear([QuantizedPart(3, raw)], linear.in_features, bias)
        assert self.inner.packed is not None, "the integer-dot packing serves Q4_1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _to_gguf(model) -> None:
    for layer in model.model.decoder_layers:
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            setattr(owner, name, _GGUFProjection(getattr(owner, name)))


def make_model(arch: str, tie: bool, dtype: torch.dtype = torch.bfloat16, int8: bool = False,
               gguf: bool = False, int4: bool = False):
    """``int8`` / ``int4``: the decoder's linears quantized on load (``--quantization
    int8`` / ``int4``: groups of 64 inputs, 32 for the 96-input down projection);
    ``gguf``: on Q4_1 blocks (``--quantization gguf``)."""
    # vocab 112, a multiple of 16: the packed head (and its argmax pass) serves
    config = tiny_config(arch, vocab=112, hidden=64, ffn=96, layers=3, head_dim=32, max_len=256,
                         tie_word_embeddings=tie, **ARCHS[arch])
    hf = tiny_hf_model(config, std=0.15, norms=(0.5, 1.5))
    model = build_model(hf.config, hf.state_dict(), dtype, "cpu", 256)
    if int8:
        finish_model(model, Int8OnLoad())
        assert isinstance(model.model.decoder_layers[0].mlp.down_proj, Int8Linear)
        # the LM head per row in int8 too (its own, or a copy of the tied embedding)
        assert isinstance(model.lm_head if not tie else model.tied_lm_head, Int8Linear)
    if int4:
        finish_model(model, Int4OnLoad())
        down = model.model.decoder_layers[0].mlp.down_proj
        assert isinstance(down, Int4Linear) and down.wp is not None, "the W4A8 kernel's packing"
        assert isinstance(model.lm_head if not tie else model.tied_lm_head, Int8Linear)
    if gguf:
        _to_gguf(model)
    if dtype == torch.bfloat16:
        packed = pack_linear_layers(model)
        assert packed > 0 or int8 or int4 or (gguf and tie), "no bf16 linear is left to pack"
        model.pack_tied_lm_head()
    return model


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4", "gguf"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("num_seqs", [1, 13, 40])
def test_fused_decode_is_bit_identical_to_per_op_path(arch, tie, num_seqs, quant):
    """``int8``: every decoder linear W8A8 (int8_linear_cpu.c inside the fused step);
    ``int4``: W4A8 (int4_linear_cpu.c inside it); ``gguf``: every decoder linear on Q4_1
    blocks (gguf_dot_cpu.c inside it)."""
    model = make_model(arch, tie, int8=quant == "int8", gguf=quant == "gguf",
                       int4=quant == "int4")
    cfg = model.config
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 60, (num_seqs,), generator=gen).tolist()
    blocks_per = [(n + 4 + BLOCK - 1) // BLOCK for n in lens]
    kv = allocate_kv_cache(sum(blocks_per) + 2, cfg.num_hidden_layers, BLOCK, 2, 32, torch.bfloat16)
    ids = torch.randperm(kv.shape[0], generator=gen).tolist()
    tables, at = [], 0
    for nb in blocks_per:
        tables.append(ids[at : at + nb])
        at += nb
    views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(cfg.num_hidden_layers)]
    with torch.inference_mode():
        # prompts through the per-op path (prefills are never fused)
        prompt = [torch.randint(0, 112, (n,), generator=gen) for n in lens]
        meta = build_attention_metadata(lens, [0] * num_seqs, tables, BLOCK)
        model(torch.cat(prompt), meta.positions, views, meta)
        assert model._fused.built_for is None, "a prefill step must not build the fused path"
        done = list(lens)
        for _ in range(4):  # decode steps
            tokens = torch.randint(0, 112, (num_seqs,), generator=gen)
            meta = build_attention_metadata([1] * num_seqs, done, tables, BLOCK)
            before = kv.clone()
            model.fused_decode_enabled = False
            want = model(tokens, meta.positions, views, meta)
            want_kv = kv.clone()
            kv.copy_(before)
            model.fused_decode_enabled = True
            assert FusedDecode.serves(meta)
            got = model(tokens, meta.positions, views, meta)
            assert model._fused.built_for is views, "fused path not built"
            assert torch.equal(got, want)
            assert torch.equal(kv, want_kv)
            assert torch.equal(model.compute_logits(got), model.compute_logits(want))
            greedy = model.compute_greedy(got)  # the head's argmax pass (no logits)
            assert greedy is not None
            assert torch.equal(greedy, model.compute_logits(got, upcast=False).max(-1).indices)
            done = [d + 1 for d in done]


def test_fused_decode_declines_prefills_and_big_batches():
    model = make_model("LlamaForCausalLM", False)
    kv = allocate_kv_cache(200, 3, BLOCK, 2, 32, torch.bfloat16)
    views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(3)]
    fused = model._fused.get(model.model.decoder_layers, views,
                             torch.empty(1, 64, dtype=torch.bfloat16))
    assert fused is not None
    mixed = build_attention_metadata([1, 5], [3, 0], [[0], [1]], BLOCK)
    assert not fused.serves(mixed)
    many = build_attention_metadata([1] * 112, [3] * 112, [[i] for i in range(112)], BLOCK)
    assert not fused.serves(many)  # the packed linears take fewer than 112 rows
    assert fused.serves(
        build_attention_metadata([1] * 111, [3] * 111, [[i] for i in range(111)], BLOCK)
    )


def test_refused_fused_path_keeps_no_cache_alive():
    """Where the fused path does not apply (a float32 model), the model must not
    hold on to the KV cache views it was asked about."""
    import weakref

    model = make_model("LlamaForCausalLM", False, torch.float32)
    kv = allocate_kv_cache(8, 3, BLOCK, 2, 32, torch.float32)
    views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(3)]
    meta = build_attention_metadata([1, 1], [3, 5], [[0], [1]], BLOCK)
    with torch.inference_mode():
        model(torch.tensor([1, 2]), meta.positions, views, meta)
    assert model._fused.built_for is None
    alive = weakref.ref(kv)
    del kv, views
    assert alive() is None
