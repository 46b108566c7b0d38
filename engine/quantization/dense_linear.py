"""Linears over whole-row quantized weights: ``Int8Linear`` (W8A8, per-output-channel
symmetric int8 weights with dynamic per-token activation scales: compressed-tensors
``int-quantized`` and on-load ``int8``) and ``Fp8Linear`` (FP8 E4M3 weights with
per-tensor, per-channel or block scales, computed weight-only in the compute dtype:
compressed-tensors ``float-quantized`` and ``quant_method: fp8``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.quantization.base import QuantLinear
from tandem.kernels import cpu_ext
from tandem.kernels.quant.fp8_gemm import (
    Fp8Path,
    cuda_capability,
    fp8_gemm_path,
    fp8_scaled_mm_linear,
)
from tandem.kernels.quant.grouped import TILE_ROWS, int8_rowwise_linear
from tandem.kernels.quant.int8_native import PackedInt8, int8_linear, pack_int8
from tandem.kernels.quant.triton_grouped import int8_weight_linear_triton


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization: ``w [out, in]`` float -> ``(q [out, in] int8,
    scales [out] float32)`` with ``scales = max|w[n]| / 127``, ``q = round(w / scales)``."""
    w32 = w.detach().float()
    scales = w32.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w32 / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Linear(QuantLinear):
    """W8A8 linear; checkpoint tensors ``weight [out, in]`` int8 and ``weight_scale
    [out, 1]`` (compressed-tensors' channel strategy). ``set_int8`` fills it directly
    (on-load). Buffers after loading: ``scale [out]`` float32 and either the native
    kernel's packing of the weight (``wp``, ``wsum``: ``kernels/quant/int8_native.py``;
    CPU weights where the native library loads) or ``q [out, in]`` int8 for the torch
    reference (``int8_rowwise_linear``); one copy of the weight either way."""

    q: torch.Tensor | None
    wp: torch.Tensor | None
    wsum: torch.Tensor | None
    scale: torch.Tensor

    def add_checkpoint_tensors(self) -> None:
        self.add_checkpoint_param("weight", (self.out_features, self.in_features), torch.int8,
                                  out_dim=0)
        self.add_checkpoint_param("weight_scale", (self.out_features, 1), torch.float32,
                                  out_dim=0)

    def set_int8(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Take ``q [out, in]`` int8 and ``scale`` (``[out]`` or ``[out, 1]``) float."""
        packed = pack_int8(q) if q.device.type == "cpu" else None
        self.register_buffer("q", None if packed else q.contiguous(), persistent=False)
        self.register_buffer("wp", packed.wp if packed else None, persistent=False)
        self.register_buffer("wsum", packed.wsum if packed else None, persistent=False)
        self.register_buffer("scale", scale.float().reshape(-1).contiguous(), persistent=False)

    def finish_loading(self, prefix: str) -> None:
        q, s = self.ckpt("weight"), self.ckpt("weight_scale")
        self.drop_checkpoint_params("weight", "weight_scale")
        self.set_int8(q, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            assert self.q is not None, "a CUDA Int8Linear keeps q (set_int8 on CUDA tensors)"
            return int8_weight_linear_triton(x, self.q, self.scale, self.bias)
        if self.q is not None:
            return int8_rowwise_linear(x, self.q, self.scale, self.bias)
        assert self.wp is not None and self.wsum is not None, "set_int8 was not called"
        packed = PackedInt8(self.wp, self.wsum, self.out_features, self.in_features)
        return int8_linear(x, packed, self.scale, self.bias)

    def forward_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Row-wise argmax of ``forward(x)`` (``[..., in]`` -> ``[...]`` int64, the first
        maximal index): the greedy path of an int8 LM head, equal to the argmax of the
        logits a logprobs request reads. ``None`` on CUDA (the caller samples logits).

        The logits are written (``[rows, out]`` in ``x.dtype``) and read once by the
        native row argmax: beside the weight's bytes that write is small, so a kernel
        that never writes them would save little."""
        if x.is_cuda:
            return None
        logits = self.forward(x.reshape(-1, self.in_features))
        ids = cpu_ext.argmax_rows_cpu(logits)
        if ids is None:
            ids = logits.max(dim=-1).indices
        return ids.view(x.shape[:-1])


class Fp8Linear(QuantLinear):
    """FP8 (E4M3) weights ``w8 [out, in]`` with float32 scales ``scale``: ``[out]``
    (per-tensor scales expanded per part, or per-channel) or ``[ceil(out / b0),
    ceil(in / b1)]`` blocks (``block``); forward dequantizes ``TILE_ROWS`` rows at a time.

    Args (beyond ``QuantLinear``'s):
        strategy: "tensor", "channel" or "block"; ``block``: ``(b0, b1)`` for "block".
        scale_name: the checkpoint's scale tensor ("weight_scale", "weight_scale_inv").
    """

    w8: torch.Tensor
    scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, part_sizes: list[int],
                 bias: bool, dtype: torch.dtype, strategy: str,
                 block: tuple[int, int] | None = None, scale_name: str = "weight_scale"):
        super().__init__(in_features, out_features, part_sizes, bias, dtype)
        self.strategy, self.block, self.scale_name = strategy, block, scale_name
        n, k = out_features, in_features
        self.add_checkpoint_param("weight", (n, k), torch.float8_e4m3fn, out_dim=0)
        if strategy == "tensor":
            self.add_checkpoint_param(scale_name, (len(part_sizes), 1), torch.float32,
                                      per_part=True)
        elif strategy == "channel":
            self.add_checkpoint_param(scale_name, (n, 1), torch.float32, out_dim=0)
        else:
            assert block is not None
            b0, b1 = block
            self.add_checkpoint_param(scale_name, (-(-n // b0), -(-k // b1)), torch.float32,
                                      out_dim=0, out_pack=b0)

    def finish_loading(self, prefix: str) -> None:
        w = self.ckpt("weight")
        s = getattr(self, self.scale_name).detach()
        if self.strategy == "tensor":
            s = torch.repeat_interleave(s.reshape(-1), torch.tensor(self.part_sizes))
        elif self.strategy == "channel":
            s = s.reshape(-1)
        self.drop_checkpoint_params("weight", self.scale_name)
        self.register_buffer("w8", w, persistent=False)
        self.register_buffer("scale", s.float().contiguous(), persistent=False)

    def _rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        w = self.w8[rows].float()
        if self.block is None:
            return (w * self.scale[rows, None]).to(dtype)
        b0, b1 = self.block
        s = self.scale[rows.start // b0: -(-rows.stop // b0)]
        s = s.repeat_interleave(b0, 0)[rows.start % b0: rows.start % b0 + w.shape[0]]
        s = s.repeat_interleave(b1, 1)[:, : w.shape[1]]
        return (w * s).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            path = fp8_gemm_path(cuda_capability(x.get_device()), x.dtype, self.out_features,
                                 self.in_features, self.block is not None)
            if path is not Fp8Path.DEQUANT:
                return fp8_scaled_mm_linear(x, self.w8, self.scale, self.bias, path)
        x2 = x.reshape(-1, self.in_features)
        n = self.out_features
        out = x2.new_empty((x2.shape[0], n))
        step = TILE_ROWS if self.block is None else TILE_ROWS // self.block[0] * self.block[0]
        step = max(step, self.block[0] if self.block else 1)
        for start in range(0, n, step):
            rows = slice(start, min(start + step, n))
            out[:, rows] = F.linear(x2, self._rows(rows, x2.dtype))
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], n)
