"""gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"), as transformers'
``modeling_gpt_oss.py`` defines it, on the Llama decoder:

- attention with biases on Q/K/V/O, a learned sink logit per head (``self_attn.sinks``:
  an extra softmax column whose value is dropped; ``paged_attention(sinks=...)``), and
  alternating sliding-window / full layers (``config.layer_types``);
- YaRN rotary embedding (Peng et al. 2023), its cos/sin scaled by YaRN's attention
  factor, computed by transformers' own ``ROPE_INIT_FUNCTIONS``;
- a MoE feed-forward in every layer: ``router`` with a bias, top-k of the logits then a
  softmax over the k, experts with biases and the clamped SwiGLU
  (``kernels/moe.swiglu_oai``, ``swiglu_alpha`` / ``swiglu_limit``).

The checkpoint stores the experts stacked and transposed, gate and up interleaved
column by column (``experts.gate_up_proj [E, hidden, 2I]``, ``down_proj [E, I, hidden]``);
``convert_expert_tensor`` turns them into the block's ``[E, 2I, hidden]`` gate-then-up rows.
MXFP4-quantised checkpoints (``*_blocks`` / ``*_scales``) are refused naming the tensor:
dequantise them to bf16 first.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from tandem.engine.model_facts import head_dim_of, rope_params
from tandem.engine.models.llama import Attention
from tandem.engine.models.moe import MoESpec
from tandem.engine.models.moe_models import MoeCausalLM
from tandem.kernels.rotary import RotaryEmbedding


class GptOssForCausalLM(MoeCausalLM):
    """gpt-oss: biased attention with sinks + YaRN + biased clamped-SwiGLU experts."""

    moe_spec = staticmethod(MoESpec.gpt_oss)

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, max_position, dtype, device)
        for layer in self.model.decoder_layers:
            attn = cast(Attention, layer.self_attn)  # gpt-oss layers are GQA
            attn.sinks = nn.Parameter(torch.empty(attn.num_heads))

    @staticmethod
    def make_rotary(
        config: Any, max_position: int, dtype: torch.dtype, device: torch.device | str
    ) -> RotaryEmbedding:
        """Rotary tables with transformers' inverse frequencies and attention factor for
        the config's ``rope_type`` (YaRN for gpt-oss), computed in float32."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        theta, scaling = rope_params(config)
        rotary = RotaryEmbedding(head_dim_of(config), max_position, theta, None, dtype, device)
        if scaling is None:
            return rotary
        rope_type = str(scaling.get("rope_type", scaling.get("type")))
        with torch.device("cpu"):  # build_model constructs the model under the meta device
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
            pos = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())
        rotary.cos = (freqs.cos() * factor).to(dtype=dtype, device=device)
        rotary.sin = (freqs.sin() * factor).to(dtype=dtype, device=device)
        return rotary

    @staticmethod
    def convert_expert_tensor(suffix: str, t: torch.Tensor) -> torch.Tensor:
        """gpt-oss's stacked experts in the block's layout: ``gate_up_proj [E, H, 2I]``
        (interleaved) -> ``[E, 2I, H]`` gate rows then up rows; its bias ``[E, 2I]``
        likewise; ``down_proj [E, I, H]`` -> ``[E, H, I]``.

        Raises:
            ValueError: for MXFP4 ``*_blocks`` / ``*_scales`` tensors.
        """
        if suffix.endswith(("_blocks", "_scales")):
            raise ValueError("MXFP4-quantised experts are not supported; dequantise the "
                             "checkpoint to bf16 (transformers' Mxfp4Config(dequantize=True))")
        if suffix == "experts.gate_up_proj":
            t = t.transpose(1, 2)
            return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
        if suffix == "experts.gate_up_proj_bias":
            return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
        if suffix == "experts.down_proj":
            return t.transpose(1, 2)
        return t

    def _load_one(
        self,
        name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
    ) -> None:
        """``MoeCausalLM._load_one`` plus the attention sinks (this rank's heads)."""
        if not name.endswith(".self_attn.sinks"):
            super()._load_one(name, tensor, params, loaded)
            return
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
        h0 = self.shard.tp_rank * self.shard.num_heads
        part = tensor[h0 : h0 + self.shard.num_heads]
        if part.shape != param.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{self.shard.num_heads * self.shard.tp_size} heads")
        param.data.copy_(part)
        loaded.add(name)
