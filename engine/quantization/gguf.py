"""``quantization="gguf"``: a ``.gguf`` model's linear layers kept in their file's blocks.

The file is read with ``gguf.GGUFReader`` (public API). Each tensor's GGUF name maps onto
the Hugging Face name transformers gives it (``blk.N.attn_q.weight`` ->
``model.layers.N.self_attn.q_proj.weight``, the table of transformers'
``integrations/ggml.py`` for the llama family). Decoder projections of a quantized type
(``kernels/gguf_quants.py``) travel as raw blocks under ``<hf prefix>.qweight`` into
``GGUFQuantLinear`` (``kernels/gguf_linear.GGUFLinear`` once loaded); every other tensor
(norms, biases, F32/F16 weights) is dequantized. A quantized token embedding also becomes
the tied LM head's ``GGUFLinear`` (``attach_gguf_head``).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of llama-family models
(its rotary pairs interleaved, ``convert_hf_to_gguf.py``'s ``permute``); transformers undoes
it at load (``reverse_permute``), and so does ``_unpermute`` here, on whole rows of blocks,
so the blocks stay intact.

A fused projection's parts may differ in type (Q4_K_M stores ``attn_v`` as Q6_K beside
Q4_K ``attn_q``/``attn_k``): each part's rows are zero-padded to the widest part's bytes
for the shared ``qweight`` and cut back to their own width in ``finish_loading``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.engine.quantization.base import QuantizationMethod, QuantLinear
from tandem.kernels import gguf_quants
from tandem.kernels.gguf_linear import GGUFEmbedding, GGUFLinear, QuantizedPart

_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_SIBLINGS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
             "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
             "up_proj": ("gate_proj", "up_proj")}
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PERMUTED_ARCHS = ("llama", "mistral")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor name.

    Raises:
        ValueError: a name outside the llama-family table.
    """
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m.group(2) not in _LAYER:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name here "
                         "(llama-family tensors only)")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def _unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' ``reverse_permute_weights`` on whole rows (dim 0)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass
class GGUFCheckpoint:
    """A GGUF file's tensors under Hugging Face names.

    Attributes:
        path: the file; types: HF prefix of each quantized projection -> ggml type id;
        row_bytes: HF prefix -> bytes per row its ``qweight`` is padded to;
        embedding: the token embedding's blocks when quantized (for the tied head; read
            by ``iter_weights``); embedding_type: its ggml type id then (from the scan).
    """

    path: str
    arch: str
    n_head: int
    n_kv_head: int
    types: dict[str, int] = field(default_factory=dict)
    row_bytes: dict[str, int] = field(default_factory=dict)
    embedding: QuantizedPart | None = None
    embedding_dim: int = 0
    embedding_type: int | None = None


def open_checkpoint(path: str, hf_config: Any) -> GGUFCheckpoint:
    """Scan ``path``'s tensor table: which projections are quantized, of what type.

    Raises:
        ValueError: naming the tensor: an unknown GGUF type or a name without an HF name.
    """
    import gguf

    reader = gguf.GGUFReader(path)
    field_ = reader.fields.get("general.architecture")
    arch = bytes(field_.parts[-1]).decode() if field_ is not None else ""
    ck = GGUFCheckpoint(path, arch, int(hf_config.num_attention_heads),
                        int(getattr(hf_config, "num_key_value_heads", None)
                            or hf_config.num_attention_heads))
    for t in reader.tensors:
        tid = int(t.tensor_type)
        if tid in _FLOAT_TYPES:
            continue
        qt = gguf_quants.gguf_type(tid, t.name)
        name = hf_name(t.name)
        prefix, _, kind = name.rpartition(".")
        if name == "model.embed_tokens.weight":
            ck.embedding_type = tid
        if kind == "weight" and prefix.split(".")[-1] in _PROJECTIONS:
            ck.types[prefix] = tid
            ck.row_bytes[prefix] = int(t.shape[0]) // qt.block * qt.type_size
    for prefix in list(ck.row_bytes):
        base, _, proj = prefix.rpartition(".")
        sibs = [f"{base}.{s}" for s in _SIBLINGS.get(proj, (proj,))]
        ck.row_bytes[prefix] = max(ck.row_bytes.get(s, 0) for s in sibs)
    return ck


def iter_weights(ck: GGUFCheckpoint, dequantize_all: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)``: raw blocks as ``<prefix>.qweight`` (uint8 ``[rows,
    row_bytes]``) for the quantized projections of ``ck.types`` (none when
    ``dequantize_all``), float32 for everything else; Q/K rows un-permuted.

    Raises:
        ValueError: naming the tensor: an unknown type or blocks of the wrong size.
    """
    import gguf

    reader = gguf.GGUFReader(ck.path)
    for t in reader.tensors:
        name = hf_name(t.name)
        prefix = name.rpartition(".")[0]
        tid = int(t.tensor_type)
        cols, rows = int(t.shape[0]), int(np.prod(t.shape[1:]))
        data = torch.from_numpy(np.array(t.data))
        if tid in _FLOAT_TYPES:
            value = data.view(_FLOAT_TYPES[tid]).float().reshape(rows, cols).squeeze(0)
            raw = None
        else:
            qt = gguf_quants.gguf_type(tid, t.name)
            raw = data.reshape(rows, -1) if data.numel() else data.reshape(0, 0)
            gguf_quants.check_blocks(qt, raw, rows, cols, t.name)
        n_head = {"q_proj": ck.n_head, "k_proj": ck.n_kv_head}.get(prefix.split(".")[-1])
        unpermute = ck.arch in _PERMUTED_ARCHS and n_head is not None
        if raw is not None and prefix in ck.types and not dequantize_all:
            if unpermute and n_head is not None:
                raw = _unpermute(raw, n_head)
            pad = ck.row_bytes[prefix] - raw.shape[1]
            if pad:
                raw = torch.nn.functional.pad(raw, (0, pad))
            yield f"{prefix}.qweight", raw.contiguous()
            continue
        if raw is not None:
            if name == "model.embed_tokens.weight":
                ck.embedding, ck.embedding_dim = QuantizedPart(tid, raw.contiguous()), cols
            value = gguf_quants.dequantize(tid, raw, cols, t.name)
        if unpermute and n_head is not None:
            value = _unpermute(value, n_head)
        yield name, value


class GGUFQuantLinear(QuantLinear):
    """A decoder projection in GGUF blocks (``kernels/gguf_linear.GGUFLinear`` computes).

    Checkpoint tensor: ``qweight`` uint8 ``[out_features, row_bytes]`` (each fused part's
    rows zero-padded to ``row_bytes``); ``part_types``: ggml type id per part.
    """

    def __init__(self, linear: nn.Linear, part_sizes: list[int], part_types: list[int],
                 row_bytes: int, dtype: torch.dtype) -> None:
        super().__init__(linear.in_features, linear.out_features, part_sizes,
                         linear.bias is not None, dtype)
        self.part_types = part_types
        self.add_checkpoint_param("qweight", (linear.out_features, row_bytes), torch.uint8,
                                  out_dim=0)
        self.inner: GGUFLinear | None = None

    def finish_loading(self, prefix: str) -> None:
        """Cut each part to its type's row width and check it (errors name the tensor)."""
        parts, lo = [], 0
        q = self.qweight
        assert isinstance(q, torch.Tensor)
        for n, tid in zip(self.part_sizes, self.part_types, strict=True):
            t = gguf_quants.gguf_type(tid, f"{prefix}.qweight")
            width = self.in_features // t.block * t.type_size
            parts.append(QuantizedPart(tid, q[lo : lo + n, :width].contiguous()))
            lo += n
        bias = None if self.bias is None else self.bias.detach()
        self.inner = GGUFLinear(parts, self.in_features, bias, f"{prefix}.qweight")
        self.drop_checkpoint_params("qweight")
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.inner is not None, "finish_loading first"
        return self.inner(x)


class GGUFMethod(QuantizationMethod):
    """``quantization="gguf"``, implied by a ``.gguf`` file with quantized projections."""

    name = "gguf"

    def __init__(self, checkpoint: GGUFCheckpoint | None) -> None:
        self.checkpoint = checkpoint

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> GGUFMethod:
        ck = qcfg.get("gguf_checkpoint")
        if ck is None:
            raise ValueError("quantization 'gguf' needs a .gguf model file")
        return cls(ck)

    def quantizes(self, prefix: str) -> bool:
        return self.checkpoint is not None and any(
            f"{prefix.rpartition('.')[0]}.{p}" in self.checkpoint.types
            for p in _FUSED.get(prefix.rpartition(".")[2], (prefix.rpartition(".")[2],)))

    def create_linear(self, linear: nn.Linear, part_sizes: list[int], prefix: str,
                      dtype: torch.dtype) -> QuantLinear:
        assert self.checkpoint is not None
        base, _, proj = prefix.rpartition(".")
        names = [f"{base}.{p}" for p in _FUSED.get(proj, (proj,))]
        missing = [n for n in names if n not in self.checkpoint.types]
        if missing:
            raise ValueError(f"quantization gguf: {', '.join(missing)} not quantized beside "
                             f"the other parts of {prefix}")
        types = [self.checkpoint.types[n] for n in names]
        return GGUFQuantLinear(linear, part_sizes, types, self.checkpoint.row_bytes[names[0]],
                               dtype)


class NoQuantization(QuantizationMethod):
    """``quantization="none"``: a ``.gguf`` model dequantized to the compute dtype at load
    (transformers' GGUF support), the explicit alternative to ``gguf``; for other
    checkpoints the same as leaving ``quantization`` unset. The loader resolves it to no
    method before the model is built."""

    name = "none"
    on_load = True

    @classmethod
    def from_config(cls, qcfg: dict[str, Any]) -> NoQuantization:
        return cls()

    def quantizes(self, prefix: str) -> bool:
        return False


def attach_gguf_head(model: Any, ck: GGUFCheckpoint) -> bool:
    """Give a tied-embedding model a ``GGUFLinear`` head on the quantized embedding's
    blocks (``tied_lm_head``), and make its token embedding a ``GGUFEmbedding`` on the
    same blocks (a lookup dequantizes only the rows it reads, so the dequantized table is
    not kept: what the blocks save goes to the KV cache); returns whether it did."""
    if ck.embedding is None or getattr(model, "lm_head", None) is not None:
        return False
    if not hasattr(model, "tied_lm_head") or model.tied_lm_head is not None:
        return False
    model.tied_lm_head = GGUFLinear([ck.embedding], ck.embedding_dim, None,
                                    "token_embd.weight")
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    # one rank's whole vocabulary (quantization refuses TP > 1 before this)
    if embed is not None and getattr(embed, "tp_size", 1) == 1 and isinstance(
            getattr(embed, "weight", None), torch.Tensor):
        model.model.embed_tokens = GGUFEmbedding(ck.embedding, ck.embedding_dim,
                                                 embed.weight.dtype, "token_embd.weight")
    return True
