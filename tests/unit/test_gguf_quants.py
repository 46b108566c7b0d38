"""GGUF block unpacking (kernels/gguf_quants.py) against the gguf package's reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import TYPE_NAMES, random_blocks

from tandem.kernels import gguf_quants


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_unpacking_equals_gguf_reference(name):
    """Bit-equal to gguf.quants.dequantize on random blocks of every type."""
    t = gguf_quants.BY_NAME[name]
    assert t.type_id == int(gguf.GGMLQuantizationType[name])
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == (t.block, t.type_size)
    raw = random_blocks(name, 8, 512)
    want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name])
    got = gguf_quants.dequantize(t.type_id, raw, 512)
    assert got.dtype == torch.float32 and got.shape == (8, 512)
    np.testing.assert_array_equal(got.numpy(), want)


def test_unknown_type_names_the_tensor():
    with pytest.raises(ValueError, match=r"blk\.3\.attn_q\.weight: GGUF quantization type 20"):
        gguf_quants.dequantize(20, torch.zeros(2, 18, dtype=torch.uint8), 32, "blk.3.attn_q.weight")


def test_corrupted_blocks_name_the_tensor():
    raw = random_blocks("Q4_1", 4, 64)[:, :-1]  # one byte short per row
    with pytest.raises(ValueError, match=r"token_embd\.weight: Q4_1 \[4, 64\] needs uint8"):
        gguf_quants.dequantize(3, raw, 64, "token_embd.weight")
    with pytest.raises(ValueError, match="not whole blocks"):
        gguf_quants.dequantize(3, random_blocks("Q4_1", 4, 64), 48, "w")
