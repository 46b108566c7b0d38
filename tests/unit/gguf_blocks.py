"""Random GGUF blocks for the tests: valid bytes of each quantized type, with finite
half-precision scales (random bytes elsewhere cover every quant value)."""

from __future__ import annotations

import numpy as np
import torch

from tandem.kernels.gguf_quants import BY_NAME

# byte offsets of each type's half-precision scales within a block
_HALVES = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
TYPE_NAMES = list(_HALVES)


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """``[rows, cols / block * type_size]`` uint8 blocks of type ``name``."""
    t = BY_NAME[name]
    rng = np.random.default_rng(seed)
    nb = rows * cols // t.block
    raw = rng.integers(0, 256, size=(nb, t.type_size), dtype=np.uint8)
    for off in _HALVES[name]:
        scale = (rng.random(nb) * 0.02 + 0.001).astype(np.float16)
        if off == 2 and name in ("Q4_1", "Q5_1"):
            scale = (-(rng.random(nb) * 0.1)).astype(np.float16)  # a block min
        raw[:, off : off + 2] = scale.view(np.uint8).reshape(nb, 2)
    return torch.from_numpy(raw.reshape(rows, -1).copy())
