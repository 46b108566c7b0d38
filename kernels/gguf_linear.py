"""Linear and embedding layers on GGUF quantized blocks (``kernels/gguf_quants.py``).

The weight stays in its file's blocks (Q4_0 ... Q6_K: 4.5-8.5 bits a weight instead of
bf16's 16). A weight whose parts are all one of Q4_0, Q4_1, Q8_0 is repacked once for the
integer-dot kernel (``kernels/gguf_dot.py``: activations quantized per 32-block to int8,
VPDPBUSD on the codes), which then serves every batch size and the fused decode step;
its blocks are recovered from the packing when needed. Otherwise decode-sized batches (fewer than ``DENSE_MIN_ROWS`` rows) run the native
kernel (``kernels/csrc/gguf_quant_cpu.c``), which expands the blocks to float32 in
registers; larger batches (prefill) dequantize the weight once per call into the
activation dtype (natively, else the torch reference) and run torch's GEMM, where
the dequantization is amortised over the rows. Without the native library every call
is the torch reference: dequantize, then matmul.

An embedding dequantizes only the rows its ids read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import backend, gguf_dot, gguf_quants
from tandem.kernels.native_abi import ABI, NativeLibrary

PATH_SCALAR = ABI.constants["TANDEM_GGUF_SCALAR"]
PATH_AVX2 = ABI.constants["TANDEM_GGUF_AVX2"]
PATH_AVX512 = ABI.constants["TANDEM_GGUF_AVX512"]
# From this many rows a call dequantizes the weight for torch's GEMM: the kernel
# re-expands each block per group of rows, the GEMM's throughput wins past here.
DENSE_MIN_ROWS = 32


def _lib() -> NativeLibrary | None:
    return backend.current().native()


@dataclass
class QuantizedPart:
    """Consecutive output rows of one quantization type (a fused QKV projection may
    join tensors of different types, e.g. Q4_K_M's Q4_K q/k and Q6_K v).

    Attributes:
        type_id: ggml type id; raw: ``[rows, K / block * type_size]`` uint8 blocks.
    """

    type_id: int
    raw: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])


def _check(part: QuantizedPart, cols: int, what: str) -> None:
    t = gguf_quants.gguf_type(part.type_id, what)
    gguf_quants.check_blocks(t, part.raw, part.rows, cols, what)


def dequantize_rows(
    part: QuantizedPart,
    cols: int,
    dtype: torch.dtype = torch.float32,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of a quantized matrix as ``dtype`` (float32 exactly as
    ``gguf_quants.dequantize``; bf16 rounded to nearest even from it).

    Args:
        part: the blocks; cols: elements per row.
        ids: ``[n]`` int64 row indices (``None``: every row), in range (checked).

    Returns:
        ``[n, cols]`` in ``dtype``.

    Raises:
        IndexError: an id out of range.
    """
    if ids is not None:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= part.rows):
            raise IndexError(f"row id out of range for {part.rows} rows")
    lib = _lib()
    if lib is None or dtype not in (torch.float32, torch.bfloat16) or not part.raw.is_contiguous():
        raw = part.raw if ids is None else part.raw[ids]
        return gguf_quants.dequantize(part.type_id, raw, cols).to(dtype)
    n = part.rows if ids is None else ids.numel()
    out = torch.empty((n, cols), dtype=dtype)
    rc = lib.gguf_dequant_rows(
        part.type_id, part.raw.data_ptr(), part.raw.shape[1],
        None if ids is None else ids.data_ptr(), n, cols, out.data_ptr(), cols,
        int(dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"gguf_dequant_rows failed with code {rc}")
    return out


def gguf_matmul(x: torch.Tensor, part: QuantizedPart, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``x @ dequant(W)^T`` on the native kernel (the torch reference without it).

    Args:
        x: ``[M, K]`` float32 with unit last stride; part: ``W`` ``[N, K]``'s blocks.
        out: optional ``[M, N]`` float32 view to write (row stride any, unit column
            stride), e.g. a column slice of a fused layer's output.

    Returns:
        ``[M, N]`` float32 (``out`` when given).

    Raises:
        ValueError: ``x`` not float32 ``[M, K]`` with unit last stride.
        RuntimeError: the kernel rejects the type or shape.
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"gguf_matmul takes float32 [M, K] unit-stride x, got {x.dtype} "
                         f"{list(x.shape)} strides {x.stride()}")
    M, K = x.shape
    if out is None:
        out = torch.empty((M, part.rows), dtype=torch.float32)
    lib = _lib()
    if lib is None or not part.raw.is_contiguous():
        out.copy_(x @ gguf_quants.dequantize(part.type_id, part.raw, K).T)
        return out
    rc = lib.gguf_matmul(part.type_id, x.data_ptr(), x.stride(0), M, K, part.raw.data_ptr(),
                         part.rows, out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"gguf_matmul failed with code {rc}")
    return out


class GGUFLinear(nn.Module):
    """``y = x @ dequant(W)^T + b`` with ``W`` kept in GGUF blocks.

    Args:
        parts: the weight's row ranges, in output order (their rows sum to
            ``out_features``), each checked against ``in_features``.
        in_features: ``K``; bias: ``[out_features]`` or ``None``.
        name: the layer's name for error messages.

    Forward: ``x [..., K]`` (float32 / bf16 / fp16) -> ``[..., N]`` in ``x.dtype``;
    float32 accumulation.

    Raises:
        ValueError: a part of an unknown type or the wrong block shape, naming ``name``.
    """

    def __init__(self, parts: list[QuantizedPart], in_features: int,
                 bias: torch.Tensor | None = None, name: str = "linear") -> None:
        super().__init__()
        for i, p in enumerate(parts):
            _check(p, in_features, name if len(parts) == 1 else f"{name} (part {i})")
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.register_buffer("bias", bias, persistent=False)
        self._part_rows = [(p.type_id, p.rows) for p in parts]
        self.packed = self._pack(parts, in_features)
        self._parts = [] if self.packed is not None else parts
        if self.packed is not None:  # buffers: .to() / state accounting see the weight
            self.register_buffer("packed_blocks", self.packed.wp, persistent=False)
        for i, p in enumerate(self._parts):
            self.register_buffer(f"blocks_{i}", p.raw, persistent=False)

    @staticmethod
    def _pack(parts: list[QuantizedPart], cols: int) -> gguf_dot.PackedGGUF | None:
        """The integer-dot packing of the whole weight where every part is one type the
        kernel runs (and the library is here), else ``None``."""
        types = {p.type_id for p in parts}
        if _lib() is None or len(types) != 1 or next(iter(types)) not in gguf_dot.DOT_TYPES:
            return None
        raw = parts[0].raw if len(parts) == 1 else torch.cat([p.raw for p in parts])
        return gguf_dot.pack_gguf(parts[0].type_id, raw, cols)

    @property
    def parts(self) -> list[QuantizedPart]:
        """The weight's row ranges as the file's blocks (unpacked anew where packed)."""
        if self.packed is None:
            return self._parts
        raw, out, lo = gguf_dot.unpack_gguf(self.packed), [], 0
        for type_id, rows in self._part_rows:
            out.append(QuantizedPart(type_id, raw[lo : lo + rows]))
            lo += rows
        return out

    def weight_bytes(self) -> int:
        """Bytes of the quantized blocks (packed: the same bytes, rows padded to 16)."""
        if self.packed is not None:
            return self.packed.nbytes
        return sum(p.raw.numel() for p in self._parts)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[N, K]`` in ``dtype``."""
        mats = [dequantize_rows(p, self.in_features, dtype) for p in self.parts]
        return mats[0] if len(mats) == 1 else torch.cat(mats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.packed is not None and x2.dtype in (torch.float32, torch.bfloat16):
            bias = self.bias
            assert bias is None or isinstance(bias, torch.Tensor), "bias is a tensor or None"
            y = gguf_dot.gguf_dot_linear(x2, self.packed, bias)
            return y.view(*lead, self.out_features)
        if x2.shape[0] >= DENSE_MIN_ROWS or _lib() is None:
            wdtype = x2.dtype if x2.dtype in (torch.float32, torch.bfloat16) else torch.float32
            y = F.linear(x2.to(wdtype), self.dequantized(wdtype)).to(x.dtype)
        else:
            xf = x2.float().contiguous()
            y32 = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)
            col = 0
            for p in self.parts:
                gguf_matmul(xf, p, y32[:, col : col + p.rows])
                col += p.rows
            y = y32.to(x.dtype)
        bias = self.bias
        if isinstance(bias, torch.Tensor):
            y = y + bias.to(y.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        types = ",".join(gguf_quants.GGUF_TYPES[t].name for t, _ in self._part_rows)
        return f"in={self.in_features}, out={self.out_features}, types={types}"


class GGUFEmbedding(nn.Module):
    """An embedding table in GGUF blocks; a lookup dequantizes only the rows it reads.

    Args:
        part: ``[num_embeddings, dim / block * type_size]`` blocks; dim: ``embedding_dim``;
        dtype: the output dtype; name: for error messages.

    Forward: ``ids [...]`` int -> ``[..., dim]`` in ``dtype``.

    Raises:
        ValueError: blocks of an unknown type or wrong shape, naming ``name``.
    """

    def __init__(self, part: QuantizedPart, dim: int, dtype: torch.dtype,
                 name: str = "embedding") -> None:
        super().__init__()
        _check(part, dim, name)
        self.part = part
        self.num_embeddings = part.rows
        self.embedding_dim = dim
        self.dtype = dtype
        self.register_buffer("blocks", part.raw, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.part, self.embedding_dim, self.dtype, ids)
        return rows.view(*ids.shape, self.embedding_dim)
