"""The native CPU kernel library as the op wrappers share it: the selected build
(``load``), the limits compiled into the kernels, whether AMX tiles run here, and what
the wrappers over it share (threads per call, the tensors an elementwise kernel takes).

The wrappers, by family: ``cpu_ext.py`` (elementwise: fused add + RMSNorm, rotary,
the cache write, SiLU-and-multiply; it also re-exports every wrapper's name),
``cpu_attention.py``, ``cpu_linear.py`` and ``cpu_sampling.py``.
"""

from __future__ import annotations

import torch

from tandem.kernels import backend
from tandem.kernels.native_abi import ABI, NativeLibrary

# Limits compiled into the kernels (stack scratch per work item), from the header.
MAX_HEADS = ABI.constants["TANDEM_MAX_HEADS"]
MAX_GROUP = ABI.constants["TANDEM_MAX_GROUP"]  # query heads per KV head
MAX_HEAD_DIM = ABI.constants["TANDEM_MAX_HEAD_DIM"]
MAX_HIDDEN = ABI.constants["TANDEM_MAX_HIDDEN"]  # row length of the fused RMSNorm
VECTOR_WIDTH = ABI.constants["TANDEM_VECTOR_WIDTH"]  # floats per vector; head_dim % it == 0


def load() -> NativeLibrary | None:
    """The selected native library (``backend.current().native()``), or ``None``
    when disabled or unbuildable."""
    return backend.current().native()


def amx_available() -> bool:
    """Whether the AMX tile paths can run here: a build for a CPU with AMX-BF16
    and the tile state granted to this process by Linux (asked once per library)."""
    lib = load()
    return lib is not None and lib.tiles_available


def use_tiles(tiles: bool | None) -> bool:
    """``tiles`` resolved (``None``: where ``amx_available()``).

    Raises:
        RuntimeError: ``tiles=True`` without AMX here.
    """
    if tiles is None:
        return amx_available()
    if tiles and not amx_available():
        raise RuntimeError("tiles=True needs AMX-BF16 (see amx_available)")
    return tiles


# Below this many elements an elementwise kernel runs on the calling thread:
# waking the pool's sleeping threads (passive wait policy) costs more.
_SERIAL_NUMEL = 1 << 16


def threads_for(numel: int) -> int:
    return 1 if numel < _SERIAL_NUMEL else torch.get_num_threads()


def elementwise_ok(*tensors: torch.Tensor) -> bool:
    t0 = tensors[0]
    return (
        t0.device.type == "cpu"
        and t0.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == t0.dtype and t.device == t0.device for t in tensors)
        and load() is not None
    )
