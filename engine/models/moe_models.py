"""Native MoE families on the Llama decoder: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is ``LlamaForCausalLM``'s attention and decoder (``engine/models/llama.py``) with the
feed-forward of its sparse layers replaced by a ``SparseMoeBlock``
(``engine/models/moe.py``) through the ``make_mlp`` hook; ``MoeCausalLM`` holds what they
share (the block per layer, the checkpoint names of the experts, no fused CPU decode:
``kernels/fused_decode.py`` runs dense SwiGLU layers only).

- Qwen3-MoE (Qwen team 2025): Qwen3's attention (per-head q/k RMSNorm), softmax routing
  renormalised when ``norm_topk_prob``; layers listed in ``mlp_only_layers`` or off the
  ``decoder_sparse_step`` keep a dense MLP of ``intermediate_size``.
- Qwen2-MoE (Qwen team 2024): Qwen2's attention (Q/K/V bias), plus a shared expert of
  ``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``.
- Mixtral (Jiang et al. 2024): Mistral's attention, 8 experts of ``intermediate_size``,
  top-2 of a softmax, renormalised; its checkpoints name the block ``block_sparse_moe``
  and the experts' projections ``w1`` (gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.moe import MoESpec, SparseMoeBlock
from tandem.engine.models.sharding import ModelShard


class MoeCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers run a ``SparseMoeBlock``.

    Subclasses define ``moe_spec`` (how the family routes) and may narrow
    ``is_sparse``. Construct with ``build_model``; args and errors as
    ``LlamaForCausalLM``, plus ``ExpertShard.of``'s (naming ``enable_expert_parallel``
    or ``tensor_parallel_size`` when the experts do not split over the ranks).
    """

    #: experts split whole over the TP ranks with ``enable_expert_parallel``
    supports_expert_parallel = True

    def __init__(self, config: Any, max_position: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(config, max_position, dtype, device)
        self.fused_decode_enabled = False  # the fused decode kernel runs dense MLPs only

    @staticmethod
    def moe_spec(config: Any) -> MoESpec:
        """The family's ``MoESpec``."""
        raise NotImplementedError

    @staticmethod
    def is_sparse(config: Any, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the sparse block (else the dense MLP)."""
        return True

    def make_mlp(self, config: Any, shard: ModelShard, layer: int) -> nn.Module | None:
        if not self.is_sparse(config, layer):
            return None
        return SparseMoeBlock(config, shard, self.moe_spec(config))

    @staticmethod
    def hf_name(name: str) -> str:
        """A checkpoint name in this module's terms (Mixtral's ``block_sparse_moe`` and
        gpt-oss's ``router`` are our ``mlp`` and ``gate``)."""
        return name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")

    def _moe_block(self, name: str) -> tuple[SparseMoeBlock, str, str] | None:
        """``(block, prefix, suffix)`` when ``name`` is ``<prefix>mlp.<suffix>`` of a sparse
        layer held here, else ``None``."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "mlp":
            return None
        layer = self.model.layers[int(parts[2])]
        block = getattr(layer, "mlp", None)
        if not isinstance(block, SparseMoeBlock):
            return None
        return block, ".".join(parts[:4]) + ".", ".".join(parts[4:])

    def _load_one(
        self,
        name: str,
        tensor: torch.Tensor,
        params: dict[str, nn.Parameter],
        loaded: set[str],
    ) -> None:
        """``LlamaForCausalLM._load_one``, with a sparse layer's ``mlp.*`` tensors copied
        by its block (``SparseMoeBlock.load_hf``; stacked at load).

        Raises:
            ValueError: naming the tensor, for an unexpected name or a shape mismatch.
        """
        ours = self.hf_name(name)
        found = self._moe_block(ours)
        if found is None:
            super()._load_one(ours, tensor, params, loaded)
            return
        block, prefix, suffix = found
        try:
            done = block.load_hf(suffix, self.convert_expert_tensor(suffix, tensor))
        except ValueError as e:
            raise ValueError(f"weight {name!r} for {type(self).__name__}: {e}") from None
        loaded.update(prefix + n for n in done)

    @staticmethod
    def convert_expert_tensor(suffix: str, t: torch.Tensor) -> torch.Tensor:
        """A checkpoint's expert tensor in ``SparseMoeBlock.load_hf``'s layout (a hook:
        gpt-oss transposes and de-interleaves); here unchanged."""
        return t


def _qwen_sparse(config: Any, layer: int) -> bool:
    """transformers' rule for Qwen2/3-MoE: sparse unless in ``mlp_only_layers``, on the
    ``decoder_sparse_step``."""
    only = getattr(config, "mlp_only_layers", None) or []
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer not in only and int(config.num_experts) > 0 and (layer + 1) % step == 0


class Qwen3MoeForCausalLM(MoeCausalLM):
    """Qwen3-MoE: Qwen3 attention (q/k norms) + softmax top-k experts."""

    qk_norm = True
    moe_spec = staticmethod(MoESpec.qwen_moe)
    is_sparse = staticmethod(_qwen_sparse)


class Qwen2MoeForCausalLM(MoeCausalLM):
    """Qwen2-MoE: Qwen2 attention (Q/K/V bias) + softmax top-k experts + a gated shared
    expert."""

    qkv_bias = True
    moe_spec = staticmethod(MoESpec.qwen_moe)
    is_sparse = staticmethod(_qwen_sparse)


class MixtralForCausalLM(MoeCausalLM):
    """Mixtral: Mistral attention (a uniform sliding window when set) + top-2 of 8 experts."""

    moe_spec = staticmethod(MoESpec.mixtral)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers
