"""Phi-3 (Abdin et al. 2024, "Phi-3 Technical Report"): the Llama layer with the
projections fused in the checkpoint, LongRoPE scaling and, where configured, partial
rotary. transformers' ``modeling_phi3.py`` is the numerical reference.

* ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` come fused in the checkpoint, in the
  row order of tandem's own fused parameters (q, k, v; gate, up). ``load_weights`` cuts
  them into their parts and loads those as Llama's split weights, so a TP rank takes its
  heads and MLP slice exactly as for Llama (``ModelShard.shard_hf_tensor``).
* LongRoPE (Ding et al. 2024, ``rope_scaling.type == "longrope"``, "su" in older
  configs): per-frequency ``short_factor`` / ``long_factor`` divisors and cos/sin scaled
  by the attention factor ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))``,
  ``s = max_position_embeddings / original_max_position_embeddings`` unless the config
  gives ``factor`` or ``attention_factor`` (``kernels/rotary.py``). The long factors serve
  when the engine's context exceeds ``original_max_position_embeddings``, the short ones
  otherwise (``kernels.rotary.longrope_uses_long_factors``: one rotation per engine, as
  vLLM does; transformers decides per forward call and re-prefills at the switch, so
  tandem equals it on sequences that stay on one side of the switch).
* ``partial_rotary_factor`` < 1 rotates the leading ``int(head_dim * factor)``
  dimensions of each head only.
* ``sliding_window``, when set, applies to every layer (as transformers' mask does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tandem.engine.model_facts import head_dim_of, rope_params
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.kernels.rotary import RotaryEmbedding

__all__ = ["Phi3ForCausalLM", "phi3_rope"]


def phi3_rope(config: Any) -> tuple[int, float, dict[str, Any] | None]:
    """``(rotary_dim, rope_theta, rope_scaling | None)`` of a Phi-3 config, transformers
    4.x (``rope_scaling``, ``partial_rotary_factor`` and ``original_max_position_embeddings``
    on the config) or 5.x (all in ``rope_parameters``). A LongRoPE dict is completed with
    ``original_max_position_embeddings`` and, where absent, ``factor`` (the context
    extension ``max_position_embeddings / original``, transformers' default).

    Raises:
        ValueError: a ``rope_scaling`` type other than longrope ("su", "yarn" are its old
            names in Phi-3 configs); LongRoPE without ``original_max_position_embeddings``.
    """
    theta, scaling = rope_params(config)
    params = getattr(config, "rope_parameters", None) or {}
    prf = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim_of(config) * float(prf if prf is not None else 1.0))
    if not scaling:
        return rotary_dim, theta, None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return rotary_dim, theta, None
    if kind not in ("longrope", "su", "yarn"):
        raise ValueError(f"Phi3ForCausalLM: rope_scaling type {kind!r} is not supported "
                         "(longrope)")
    scaling["rope_type"] = "longrope"
    original = scaling.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if not original:
        raise ValueError("Phi3ForCausalLM: LongRoPE needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("factor") is None:
        scaling["factor"] = config.max_position_embeddings / int(original)
    return rotary_dim, theta, scaling


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-3.5 / Phi-4-mini (``Phi3ForCausalLM``): see the module docstring.

    Construct with ``build_model`` (``engine/models/registry.py``). Args, attributes and
    errors as ``LlamaForCausalLM``, plus ``phi3_rope``'s. The one-call bf16 CPU decode
    kernel serves full-rotary configs only (it rotates whole heads).
    """

    #: the checkpoint holds qkv_proj and gate_up_proj fused, as this model does
    fused_in_checkpoint = True

    def __init__(
        self,
        config: Any,
        max_position: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(config, max_position, dtype, device)
        if phi3_rope(config)[0] != head_dim_of(config):
            self.fused_decode_enabled = False

    @staticmethod
    def make_rotary(
        config: Any, max_position: int, dtype: torch.dtype, device: torch.device | str
    ) -> RotaryEmbedding:
        """Tables over the rotated dimensions, LongRoPE's factors chosen by ``max_position``
        (the engine's context; ``ensure_max_position`` rebuilds them before any KV exists)."""
        rotary_dim, theta, scaling = phi3_rope(config)
        return RotaryEmbedding(rotary_dim, max_position, theta, scaling, dtype=dtype,
                               device=device)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` tensors as Llama's
        ``q/k/v_proj`` and ``gate/up_proj`` ones (views, rows of the full model)."""
        cfg = self.config
        d = head_dim_of(cfg)
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] == "qkv_proj":
                prefix, kind = ".".join(parts[:-2]), parts[-1]
                self._check_rows(name, tensor, q + 2 * kv)
                for part, t in zip(("q_proj", "k_proj", "v_proj"),
                                   tensor.split([q, kv, kv]), strict=True):
                    yield f"{prefix}.{part}.{kind}", t
            elif len(parts) >= 2 and parts[-2] == "gate_up_proj":
                prefix, kind = ".".join(parts[:-2]), parts[-1]
                ffn = int(cfg.intermediate_size)
                self._check_rows(name, tensor, 2 * ffn)
                for part, t in zip(("gate_proj", "up_proj"), tensor.split([ffn, ffn]),
                                   strict=True):
                    yield f"{prefix}.{part}.{kind}", t
            else:
                yield name, tensor

    @staticmethod
    def _check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{rows} rows")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` of the checkpoint with its fused projections
        cut into their parts (this rank's heads and MLP slice are taken from those).

        Raises:
            ValueError: as ``LlamaForCausalLM.load_weights``, naming the tensor; a fused
                tensor whose row count is not the config's.
        """
        super().load_weights(self._split_fused(weights))
