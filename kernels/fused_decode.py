"""All decoder layers of a decode-only step in one native call (CPU, bf16,
AVX512-BF16, on AMX tiles where the CPU has them).

Why: with nine kernel calls per layer, a small model's decode step spends a
large share of its time in Python, ctypes and OpenMP wake-ups between them. ``csrc/decode_layers_cpu.c`` runs the same kernels (the
packed bf16 linears, the fused norms, rotary, the cache write and the paged
decode attention) back to back inside one parallel region, so the result is
bit-identical to the per-op path (``tests/unit/test_fused_decode.py``).

Scope: Llama-family layers (pre-norm, fused QKV with optional bias, rotary in
the GPT-NeoX layout, SwiGLU, optional sliding window; no per-head q/k norm),
bf16 weights VNNI-packed by ``PackedLinear``, W8A8 linears packed by ``Int8Linear``
(``kernels/quant/int8_native.py``), W4A8 ones packed by ``Int4Linear``
(``kernels/quant/int4_native.py``) or GGUF Q4_0 / Q4_1 / Q8_0 blocks packed by
``GGUFLinear`` (``kernels/gguf_dot.py``), in any mix, and steps whose every token is
the one new token of a decode (fewer than ``PACKED_MAX_ROWS``). Anything else runs
the per-op path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tandem.kernels import cpu_ext, native_abi
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.linear import PACKED_MAX_ROWS
from tandem.kernels.quant import int8_native

# the header's structs (csrc/tandem_kernels.h), so the fields cannot drift from C
_Layer = native_abi.struct("decode_layer")
_Step = native_abi.struct("decode_step")
_Int8 = native_abi.struct("int8_weight")
_GGUF = native_abi.struct("gguf_weight")
_Int4 = native_abi.struct("int4_weight")


@dataclass
class Int8LinearParams:
    """A W8A8 linear of a fused layer (``kernels/quant/int8_native.py``'s packing).

    Attributes:
        wp / wsum: the packed int8 weight and its row sums (``pack_int8``).
        scale: ``[out]`` float32 per-channel weight scales.
        bias: ``[out]`` float32, or ``None``.
    """

    wp: torch.Tensor
    wsum: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class GGUFLinearParams:
    """A GGUF linear of a fused layer (``kernels/gguf_dot.py``'s packing).

    Attributes:
        type_id: ggml type id (Q4_0, Q4_1 or Q8_0); wp: the packed tiles.
        bias: ``[out]`` float32, or ``None``.
    """

    type_id: int
    wp: torch.Tensor
    bias: torch.Tensor | None


@dataclass
class Int4LinearParams:
    """A W4A8 linear of a fused layer (``kernels/quant/int4_native.py``'s packing).

    Attributes:
        wp / ws: the packed nibbles and group scales (``pack_int4``).
        group_size: inputs per scale group (a multiple of 8 dividing the inputs).
        bias: ``[out]`` float32, or ``None``.
    """

    wp: torch.Tensor
    ws: torch.Tensor
    group_size: int
    bias: torch.Tensor | None


#: One fused linear: ``(vnni_weight, bias | None)`` in bf16, a W8A8, W4A8 or GGUF one.
LinearParams = (
    tuple[torch.Tensor, torch.Tensor | None]
    | Int8LinearParams
    | GGUFLinearParams
    | Int4LinearParams
)


@dataclass
class DecodeLayerParams:
    """One layer's tensors for ``FusedDecode`` (all bf16 on the CPU).

    Attributes:
        input_norm / post_norm: ``[hidden]`` RMSNorm weights.
        qkv / o / gate_up / down: ``(vnni_weight, bias | None)`` of the four
            linears, weights packed by ``cpu_ext.bf16_pack_weight`` from
            ``[(H + 2 KVH) D, E]``, ``[E, H D]``, ``[2 I, E]`` (gate rows, then
            up rows) and ``[E, I]``; or ``Int8LinearParams``, ``Int4LinearParams`` or
            ``GGUFLinearParams`` of the same shapes.
        k_cache / v_cache: the layer's ``[num_blocks, block_size, KVH, D]`` views.
        sliding_window: tokens, or ``None``.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: LinearParams
    o: LinearParams
    gate_up: LinearParams
    down: LinearParams
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    sliding_window: int | None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """The decoder layers of decode-only steps as one native call.

    Args:
        layers: every layer's ``DecodeLayerParams``, in order.
        num_heads / num_kv_heads / head_dim / intermediate_size: the shapes.
        eps: RMSNorm epsilon; scale: attention softmax scale.

    Raises:
        ValueError: when the layers do not fit the kernel (see ``available``
            first): caches with different strides, a non-bf16 tensor.
    """

    def __init__(
        self,
        layers: list[DecodeLayerParams],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        eps: float,
        scale: float,
    ) -> None:
        if not layers:
            raise ValueError("layers must not be empty")
        e, i = layers[0].input_norm.shape[0], intermediate_size
        qkv = (num_heads + 2 * num_kv_heads) * head_dim
        if (
            e % 32 or (num_heads * head_dim) % 32 or i % 32 or qkv % 16 or head_dim % 16
            or head_dim > cpu_ext.MAX_HEAD_DIM or num_heads > cpu_ext.MAX_HEADS
            or num_heads % num_kv_heads or num_heads // num_kv_heads > cpu_ext.MAX_GROUP
            or e > cpu_ext.MAX_HIDDEN
        ):  # fmt: skip
            raise ValueError(
                f"shapes outside the kernel's tiling: hidden {e}, heads {num_heads}/"
                f"{num_kv_heads} x {head_dim}, intermediate {i}"
            )
        k0, v0 = layers[0].k_cache, layers[0].v_cache
        for p in layers:
            if p.k_cache.stride() != k0.stride() or p.v_cache.stride() != v0.stride():
                raise ValueError("every layer's cache view must share the first one's strides")
            if p.input_norm.dtype != torch.bfloat16 or p.k_cache.dtype != torch.bfloat16:
                raise ValueError("FusedDecode needs bf16 norms and caches")
        self.layers = layers  # keeps every pointer below alive
        self.hidden_size = layers[0].input_norm.shape[0]
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size = intermediate_size
        self.eps, self.scale = float(eps), float(scale)
        self.block_size = k0.shape[1]
        self._c_layers = (_Layer * len(layers))()
        self._int8: list[ctypes.Structure] = []  # keeps the structs the layers point at
        self._gguf: list[ctypes.Structure] = []
        self._int4: list[ctypes.Structure] = []
        self._int4_shapes: set[tuple[int, int]] = set()  # (inputs, group size)
        hd = num_heads * head_dim
        for c, p in zip(self._c_layers, layers, strict=True):
            c.input_norm, c.post_norm = _ptr(p.input_norm), _ptr(p.post_norm)
            c.wqkv, c.bqkv, c.qkv8, c.qkvq, c.qkv4 = self._linear(p.qkv, e)
            c.wo, c.bo, c.o8, c.oq, c.o4 = self._linear(p.o, hd)
            c.wgu, c.bgu, c.gu8, c.guq, c.gu4 = self._linear(p.gate_up, e)
            c.wd, c.bd, c.d8, c.dq, c.d4 = self._linear(p.down, i)
            c.k_cache, c.v_cache = _ptr(p.k_cache), _ptr(p.v_cache)
            c.window = p.sliding_window or 0
        self.has_int8 = bool(self._int8)
        self.has_gguf = bool(self._gguf)
        self.has_int4 = bool(self._int4)

    def _linear(self, p: LinearParams, k: int) -> tuple[int | None, ...]:
        """``(bf16 weight, bf16 bias, int8_weight*, gguf_weight*, int4_weight*)`` pointers
        of one linear of ``k`` inputs.

        Raises:
            ValueError: naming ``group_size`` when a W4A8 linear's does not fit ``k``.
        """
        if isinstance(p, Int8LinearParams):
            w8 = _Int8(_ptr(p.wp), _ptr(p.wsum), _ptr(p.scale), _ptr(p.bias))
            self._int8.append(w8)
            return None, None, ctypes.addressof(w8), None, None
        if isinstance(p, GGUFLinearParams):
            wq = _GGUF(p.type_id, _ptr(p.wp), _ptr(p.bias))
            self._gguf.append(wq)
            return None, None, None, ctypes.addressof(wq), None
        if isinstance(p, Int4LinearParams):
            g = p.group_size
            if g < 8 or g % 8 or k % g:
                raise ValueError(f"group_size must be a multiple of 8 dividing {k}, got {g}")
            w4 = _Int4(_ptr(p.wp), _ptr(p.ws), g, _ptr(p.bias))
            self._int4.append(w4)
            self._int4_shapes.add((k, g))
            return None, None, None, None, ctypes.addressof(w4)
        return _ptr(p[0]), _ptr(p[1]), None, None, None

    def _int4_scratch_bytes(self, lib: native_abi.NativeLibrary, tokens: int) -> int:
        """The largest ``int4_scratch_size`` of this model's W4A8 linears at ``tokens``."""
        size, most = ctypes.c_int64(), 0
        for k, g in self._int4_shapes:
            lib.int4_scratch_size(tokens, k, g, ctypes.addressof(size))
            most = max(most, size.value)
        return most

    @staticmethod
    def available() -> bool:
        """Whether this build and CPU run the fused kernel (AVX512-BF16; the linears
        and attention scores on AMX tiles where ``cpu_ext.amx_available()``)."""
        lib = cpu_ext.load()
        return lib is not None and bool(lib.decode_layers_available())

    @staticmethod
    def serves(meta: AttentionMetadata) -> bool:
        """Whether this step is decode-only and small enough for the packed linears."""
        return (
            not meta.prefills
            and meta.num_decodes == meta.num_tokens
            and meta.decode_token_idx is None
            and 0 < meta.num_tokens < PACKED_MAX_ROWS
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer on a decode-only step (``serves(meta)`` must hold).

        Args:
            hidden: ``[T, hidden]`` bf16 embeddings of the step's tokens.
            cos, sin: ``[T, 1, head_dim // 2]`` bf16 rotary tables at the positions.
            meta: the step's metadata; the new K/V are written into the caches.

        Returns:
            ``(hidden, residual)``, each ``[T, hidden]`` bf16: the last layer's MLP
            output and the residual stream, ready for the final ``add + RMSNorm``.

        Raises:
            RuntimeError: when the kernel rejects the shapes or fails to allocate.
        """
        lib = cpu_ext.load()
        assert lib is not None
        t, e = hidden.shape
        h, kvh, d, i = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        hidden = hidden.contiguous()
        cos = cos.reshape(t, d // 2).contiguous()
        sin = sin.reshape(t, d // 2).contiguous()
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        tables = meta.decode_block_tables.contiguous()
        lens = meta.decode_seq_lens.contiguous()
        slots = meta.slot_mapping.contiguous()

        def buf(*shape: int) -> torch.Tensor:
            return torch.empty(shape, dtype=torch.bfloat16)

        residual, normed = buf(t, e), buf(t, e)
        qkv, q_rot, attn, act = buf(t, (h + 2 * kvh) * d), buf(t, h * d), buf(t, h * d), buf(t, i)
        pad = buf(16, max(e, h * d, i))
        int8_path, gate_up, scratch, gguf_scratch, int4_scratch = -1, None, None, None, None
        size = ctypes.c_int64()
        if self.has_int8 or self.has_gguf or self.has_int4:
            int8_path = int8_native.available_paths(lib)[-1]
            gate_up = buf(t, 2 * i)
        if self.has_int8:
            lib.int8_scratch_size(t, max(e, h * d, i), ctypes.addressof(size))
            scratch = torch.empty(size.value, dtype=torch.uint8)
        if self.has_gguf:
            lib.gguf_dot_scratch_size(t, max(e, h * d, i), ctypes.addressof(size))
            gguf_scratch = torch.empty(size.value, dtype=torch.uint8)
        if self.has_int4:
            int4_scratch = torch.empty(self._int4_scratch_bytes(lib, t), dtype=torch.uint8)
        k0, v0 = self.layers[0].k_cache, self.layers[0].v_cache
        st = _Step(
            t, e, h, kvh, d, i,
            k0.stride(0), k0.stride(1), k0.stride(2),
            v0.stride(0), v0.stride(1), v0.stride(2), self.block_size,
            cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), lens.data_ptr(), tables.stride(0),
            self.eps, self.scale,
            hidden.data_ptr(), residual.data_ptr(), normed.data_ptr(), qkv.data_ptr(),
            q_rot.data_ptr(), attn.data_ptr(), act.data_ptr(), pad.data_ptr(),
            int8_path, _ptr(gate_up), _ptr(scratch), _ptr(gguf_scratch),
        )  # fmt: skip
        st.int4_scratch = _ptr(int4_scratch)
        rc = lib.decode_layers(
            self._c_layers,
            len(self.layers),
            ctypes.byref(st),
            int(cpu_ext.amx_available()),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"decode_layers failed with code {rc}")
        return hidden, residual
