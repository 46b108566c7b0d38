"""Quantized checkpoints of tiny models written from each format's documented packing
(independently of ``kernels/quant/packing.py``, which the tests check against these):

* GPTQ (AutoGPTQ/GPTQModel ``QuantLinear.pack``): ``qweight [in / pack, out]`` packed
  along the input axis, ``qzeros [groups, out / pack]`` along the output axis storing
  ``z - 1`` (v1), ``scales [groups, out]`` fp16, ``g_idx [in]`` int32.
* AWQ (AutoAWQ ``WQLinear_GEMM.from_linear``): ``qweight [in, out / 8]``, ``qzeros``,
  nibble ``i`` of a word holding column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``.
* compressed-tensors (``pack_to_int32``, ``PackedQuantizationCompressor``): signed
  values offset by ``2**(bits-1)``, packed along the last axis; zero points packed along
  axis 0; ``weight_shape``; int-quantized int8; float-quantized FP8.

Each ``quantize_*`` returns the checkpoint tensors of one linear and the dequantized
float32 weight the reference model loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from safetensors.torch import save_file

Tensors = dict[str, torch.Tensor]


def pack_lsb_first(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``values`` ``32 // bits`` per int32 along ``dim``, the first value
    in the lowest bits, by the formats' loop (``word |= v[j] << (bits * j)``)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, 0)
    out = torch.zeros((v.shape[0] // per, *v.shape[1:]), dtype=torch.int64)
    for j in range(per):
        out |= v[j::per] << (bits * j)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.movedim(0, dim).contiguous()


def unpack_lsb_first(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack_lsb_first`` (int64 values)."""
    per = 32 // bits
    p = packed.to(torch.int64).movedim(dim, 0) & 0xFFFFFFFF
    out = torch.empty((p.shape[0] * per, *p.shape[1:]), dtype=torch.int64)
    for j in range(per):
        out[j::per] = (p >> (bits * j)) & ((1 << bits) - 1)
    return out.movedim(0, dim)


def _group_qparams(w: torch.Tensor, bits: int, gs: int, sym: bool):
    """Per-(row, group) scale and integer zero as GPTQ's quantizer: min/max over the
    group, ``scale = (max - min) / maxq`` and ``zero = round(-min / scale)``; symmetric:
    ``zero = (maxq + 1) / 2``."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    g = w.view(n, k // gs, gs)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        amax = torch.maximum(lo.abs(), hi)
        lo, hi = -amax, amax
    scale = ((hi - lo) / maxq).clamp_min(1e-8).half().float()
    zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-lo / scale)
    return scale, zero.clamp(0, maxq)


def quantize_gptq(w: torch.Tensor, bits: int = 4, gs: int = 32, act_order: bool = False,
                  sym: bool = True, v1: bool = True, seed: int = 0) -> tuple[Tensors, torch.Tensor]:
    n, k = w.shape
    gs_ = k if gs == -1 else gs
    maxq = (1 << bits) - 1
    if act_order:  # a random column order stands in for the Hessian's
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // gs_).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // gs_).to(torch.int32)
    # quantize each group's columns (wherever they are) with its own scale and zero
    wp = w[:, torch.argsort(g_idx.long(), stable=True)]
    scale, zero = _group_qparams(wp, bits, gs_, sym)  # [n, G]
    s_col, z_col = scale[:, g_idx.long()], zero[:, g_idx.long()]  # [n, k]
    q = torch.clamp(torch.round(w / s_col) + z_col, 0, maxq)
    deq = (q - z_col) * s_col
    tensors = {
        "qweight": pack_lsb_first(q.t().contiguous(), bits, 0),
        "qzeros": pack_lsb_first((zero - (1 if v1 else 0)).t().contiguous(), bits, 1),
        "scales": scale.t().contiguous().half(),
        "g_idx": g_idx,
    }
    return tensors, deq


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    out = torch.zeros((rows, cols // 8), dtype=torch.int64)
    v = values.to(torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def quantize_awq(w: torch.Tensor, gs: int = 32) -> tuple[Tensors, torch.Tensor]:
    n, k = w.shape
    scale, zero = _group_qparams(w, 4, gs, sym=False)
    s_col, z_col = scale.repeat_interleave(gs, 1), zero.repeat_interleave(gs, 1)
    q = torch.clamp(torch.round(w / s_col) + z_col, 0, 15)
    deq = (q - z_col) * s_col
    return {"qweight": _awq_pack(q.t().contiguous()), "qzeros": _awq_pack(zero.t().contiguous()),
            "scales": scale.t().contiguous().half()}, deq


def quantize_ct_packed(w: torch.Tensor, bits: int = 4, gs: int | None = 32,
                       sym: bool = True) -> tuple[Tensors, torch.Tensor]:
    n, k = w.shape
    gs_ = k if gs is None else gs
    scale, zero = _group_qparams(w, bits, gs_, sym)
    scale = scale.bfloat16().float()  # stored in bf16
    off = 1 << (bits - 1)
    zero_signed = zero - off  # compressed-tensors keeps signed values and zero points
    s_col = scale.repeat_interleave(gs_, 1)
    z_col = zero_signed.repeat_interleave(gs_, 1)
    q = torch.clamp(torch.round(w / s_col) + z_col, -off, off - 1)
    deq = (q - z_col) * s_col
    t = {"weight_packed": pack_lsb_first(q + off, bits, 1), "weight_scale": scale.bfloat16(),
         "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        zpad = torch.cat([zero_signed + off, torch.zeros((-n % (32 // bits), zero.shape[1]))])
        t["weight_zero_point"] = pack_lsb_first(zpad, bits, 0)
    return t, deq


def quantize_ct_int8(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    s = w.abs().amax(1, keepdim=True) / 127
    q = torch.round(w / s).clamp(-127, 127)
    return {"weight": q.to(torch.int8), "weight_scale": s}, q * s


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[Tensors, torch.Tensor]:
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    s = amax / 448.0
    q = (w / (s if per_channel else s[0])).to(torch.float8_e4m3fn)
    deq = q.float() * (s if per_channel else s[0])
    return {"weight": q, "weight_scale": s if per_channel else s.reshape(1)}, deq


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized(hf_model, folder: str, quant_config: dict,
                    quantize: Callable[[torch.Tensor], tuple[Tensors, torch.Tensor]],
                    weight_key: str | None = None) -> dict[str, torch.Tensor]:
    """Write ``hf_model`` as a quantized checkpoint in ``folder`` (every decoder
    projection through ``quantize``) and return the dequantized state dict (the
    reference), which ``write_plain`` writes."""
    os.makedirs(folder, exist_ok=True)
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    out: Tensors = {}
    ref: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in PROJ and parts[-1] == "weight":
            tensors, deq = quantize(t)
            base = ".".join(parts[:-1])
            for key, value in tensors.items():
                out[f"{base}.{key}"] = value
            ref[name] = deq.float()
        else:
            out[name] = t
            ref[name] = t
    if hf_model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(folder, "model.safetensors"))
    cfg = hf_model.config.to_dict()
    cfg["quantization_config"] = quant_config
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return ref


def write_plain(hf_model, folder: str, state: dict[str, torch.Tensor]) -> None:
    os.makedirs(folder, exist_ok=True)
    if hf_model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    hf_model.config.to_json_file(os.path.join(folder, "config.json"))
