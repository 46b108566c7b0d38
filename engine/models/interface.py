"""The model seam: what the model runner, the draft proposer and the loader ask of a model.

Every implementation in ``engine/models`` (tandem's native Llama family, the Transformers
modeling backend) satisfies ``CausalLM``; the registry is typed by it and the runner
never names a model class. The shape follows vLLM v1's ``VllmModelForTextGeneration``
interface: a forward over the step's flattened tokens with the attention metadata, then
logits (or the greedy argmax) from the selected rows' hidden states.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from tandem.engine.models.sharding import ModelShard
    from tandem.kernels.attention import AttentionMetadata

#: one layer's ``(k_cache, v_cache)`` views, each
#: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype
KVCacheViews = tuple[torch.Tensor, torch.Tensor]


@dataclass
class IntermediateTensors:
    """What a pipeline stage hands the next one: the last layer's output and the
    residual stream, each ``[num_tokens, hidden_size]`` in the model dtype."""

    hidden: torch.Tensor
    residual: torch.Tensor


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only causal LM over tandem's paged KV cache.

    Built on the meta device, materialised, then filled by ``load_weights`` (see
    ``engine/models/registry.build_model``). Nothing here blocks on I/O.

    Attributes:
        shard: this rank's part of the model (heads, MLP slice, layers, vocabulary);
            the whole model with one rank.
        max_position: positions (tokens) the model's position tables cover now.
    """

    shard: ModelShard

    @property
    def max_position(self) -> int: ...

    def ensure_max_position(self, max_position: int) -> None:
        """Grow position tables (rotary cos/sin) to cover ``max_position`` tokens; a no-op
        when they already do. Mutates the model's buffers only."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheViews],
        attn_metadata: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Run this stage's layers over the step's flattened tokens.

        Args:
            input_ids: ``[num_tokens]`` int64 (read by the first pipeline stage only).
            positions: ``[num_tokens]`` int64 absolute positions.
            kv_caches: per layer of this stage, ``KVCacheViews`` of this rank's KV heads;
                the new tokens' K/V are written into them at ``attn_metadata.slot_mapping``.
            attn_metadata: the step's ``AttentionMetadata``.
            intermediate: what the previous stage returned (every stage but the first).

        Returns:
            On the last stage ``[num_tokens, hidden_size]`` final hidden states (model
            dtype); on the others the ``IntermediateTensors`` for the next stage.

        Raises:
            ValueError: a later stage called without ``intermediate``.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """``[num_seqs, hidden_size]`` -> ``[num_seqs, vocab_size]`` logits, float32 (or the
        head's dtype with ``upcast=False``). Under TP a collective: the first TP rank
        gets the logits, the others ``None``."""
        ...

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``[num_seqs]`` int64 argmax token ids straight from ``[num_seqs, hidden_size]``
        states, or ``None`` where the model has no such path (the caller then computes
        logits)."""
        ...

    def pack_tied_lm_head(self, batch_invariant: bool = False) -> bool:
        """Give a tied LM head a packed copy for this CPU (bf16 only); returns whether one
        was made. A model without the path returns False."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The model's parameters (``nn.Module.parameters``)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face state dict (``(name, tensor)`` pairs) into the parameters:
        this rank's part of each.

        Raises:
            ValueError: naming the tensor, for an unexpected name or a shape mismatch, or
                naming the parameters the checkpoint left unloaded.
        """
        ...
