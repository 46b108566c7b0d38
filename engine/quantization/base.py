"""The pieces every quantization method is made of: ``QuantizationMethod`` (which
layers it replaces, with what) and ``QuantLinear`` (a layer holding a checkpoint's
packed tensors, loaded part by part into fused projections, then repacked once).

Loading (vLLM's ``create_weights`` / ``weight_loader`` / ``process_weights_after_loading``
split): ``QuantLinear.__init__`` registers each checkpoint tensor as a ``Parameter`` via
``add_checkpoint_param`` with how it meets the layer's output axis; the model's
``load_weights`` hands each HF tensor to ``load_quant_part`` (the part of a fused
q/k/v or gate/up projection goes to its slice of that axis, a per-part tensor to its
row, an input-side tensor such as ``g_idx`` must agree across parts); ``finish_loading``
then validates and repacks into what the forward reads and drops the checkpoint tensors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

#: How a checkpoint tensor lies along the layer's output axis (``Parameter`` attribute).
OUT_DIM = "tandem_out_dim"  # int: the output axis; None: not split by output
OUT_PACK = "tandem_out_pack"  # output rows per stored entry along OUT_DIM (packing, blocks)
PER_PART = "tandem_per_part"  # one row per fused part (per-tensor scales, weight_shape)
SHARED = "tandem_shared"  # input-side: equal for every part (g_idx)


def is_quant_param(param: torch.Tensor) -> bool:
    """Whether ``param`` was registered by ``QuantLinear.add_checkpoint_param``."""
    return hasattr(param, OUT_DIM)


def load_quant_part(
    param: torch.Tensor, part: int, offsets: list[int] | None, tensor: torch.Tensor, name: str
) -> None:
    """Copy checkpoint tensor ``name`` into part ``part`` of a quantized parameter.

    Args:
        param: a parameter of a ``QuantLinear``.
        part: index of the fused part (0 for an unfused layer).
        offsets: output-row offsets of the fused parts; ``None`` for an unfused layer.
        tensor: the checkpoint tensor.
        name: its checkpoint name (for errors).

    Raises:
        ValueError: naming ``name``: a shape that does not fit, offsets that do not
            divide by the packing, a shared tensor that differs between parts.
    """
    dst: torch.Tensor = param
    if getattr(param, PER_PART, False):
        dst = param[part]
    elif getattr(param, SHARED, False):
        seen: set[int] = param.__dict__.setdefault("_tandem_parts_seen", set())
        if seen and dst.shape == tensor.shape and not torch.equal(dst, tensor.to(dst.dtype)):
            raise ValueError(
                f"quantized tensor {name!r} differs from the other parts of its fused "
                "projection (their inputs are the same, so must it be)")
        seen.add(part)
    elif getattr(param, OUT_DIM) is not None and offsets is not None:
        dim, pack = getattr(param, OUT_DIM), getattr(param, OUT_PACK)
        lo, hi = offsets[part], offsets[part + 1]
        if lo % pack or hi % pack:
            raise ValueError(f"quantized tensor {name!r}: part rows {lo}..{hi} do not divide "
                             f"by its packing of {pack} output rows per entry")
        dst = param.narrow(dim, lo // pack, (hi - lo) // pack)
    if getattr(param, PER_PART, False) and dst.numel() == tensor.numel() == 1:
        tensor = tensor.reshape(dst.shape)  # a per-tensor scale stored as [] or [1]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"quantized tensor {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(dst.shape)}")
    dst.copy_(tensor)


class QuantLinear(nn.Module):
    """Base of a quantized stand-in for ``nn.Linear`` (``y = x @ W.T + b``).

    Args:
        in_features / out_features: of the replaced layer.
        part_sizes: output rows of each fused part (``[out_features]`` unfused).
        bias: whether the layer has a bias (``[out]``, the compute dtype).
        dtype: the compute dtype.

    Subclasses register their checkpoint tensors in ``__init__``, implement
    ``finish_loading`` (validate, repack) and ``forward`` (``[..., in]`` -> ``[..., out]``).
    """

    def __init__(self, in_features: int, out_features: int, part_sizes: list[int],
                 bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.part_sizes = list(part_sizes)
        self.compute_dtype = dtype
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = self.add_checkpoint_param("bias", (out_features,), dtype, out_dim=0)

    def add_checkpoint_param(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                             out_dim: int | None = None, out_pack: int = 1,
                             per_part: bool = False, shared: bool = False) -> nn.Parameter:
        """Register checkpoint tensor ``name`` (``<layer>.<name>`` in the checkpoint) as an
        uninitialised parameter and say how it meets the output axis (``OUT_DIM`` ...)."""
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        setattr(p, OUT_DIM, out_dim)
        setattr(p, OUT_PACK, out_pack)
        setattr(p, PER_PART, per_part)
        setattr(p, SHARED, shared)
        self.register_parameter(name, p)
        return p

    def ckpt(self, name: str) -> torch.Tensor:
        """The loaded checkpoint tensor ``name`` (detached)."""
        p = self._parameters[name]
        assert p is not None, name
        return p.detach()

    def drop_checkpoint_params(self, *names: str) -> None:
        """Forget checkpoint tensors once repacked (their memory is freed)."""
        for n in names:
            delattr(self, n)

    @abstractmethod
    def finish_loading(self, prefix: str) -> None:
        """Validate the loaded tensors and repack them for ``forward``.

        Raises:
            ValueError: naming ``<prefix>.<tensor>``: contents that do not fit.
        """

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class QuantizationMethod(ABC):
    """One quantization method (a registry entry, ``engine/quantization/__init__.py``).

    Attributes:
        name: the ``--quantization`` value (vLLM's name).
        on_load: quantizes full-precision checkpoint weights after loading (int8/int4)
            instead of reading quantized tensors.
    """

    name: ClassVar[str]
    on_load: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def from_config(cls, qcfg: dict[str, Any]) -> QuantizationMethod:
        """The method for a checkpoint's ``quantization_config`` (``{}`` for on-load).

        Raises:
            ValueError: naming the unsupported setting (bits, group size, format ...).
        """

    def quantizes(self, prefix: str) -> bool:
        """Whether the linear ``prefix`` (our module name, e.g.
        ``model.layers.0.self_attn.qkv_proj``) is quantized; default every decoder
        projection."""
        return True

    def create_linear(self, linear: nn.Linear, part_sizes: list[int], prefix: str,
                      dtype: torch.dtype) -> QuantLinear:
        """A ``QuantLinear`` with the checkpoint's tensors for ``linear`` (meta device).
        Checkpoint methods override this; on-load methods override ``quantize_linear``."""
        raise NotImplementedError(f"{self.name} does not read quantized checkpoints")

    def quantize_linear(self, linear: nn.Linear, prefix: str) -> nn.Module:
        """A quantized replacement for a loaded full-precision ``linear`` (on-load)."""
        raise NotImplementedError(f"{self.name} does not quantize on load")

    def quantize_head(self, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
        """A quantized LM head for the loaded ``weight [vocab, hidden]`` (and ``bias
        [vocab]`` or ``None``) of an on-load method, or ``None`` (the default): the head
        stays in the compute dtype. The module maps ``[..., hidden]`` to ``[..., vocab]``
        in the compute dtype and may offer ``forward_argmax`` (the greedy fast path)."""
        return None

    def skip_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether to drop checkpoint tensor ``name`` before the model sees it (e.g.
        GPTQ's all-zero biases of bias-free layers)."""
        return False
