"""Mistral (Jiang et al. 2023): the Llama architecture with sliding-window attention.

transformers' ``MistralConfig`` applies ``sliding_window`` to every layer when set.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama + a uniform sliding window (``config.sliding_window`` tokens)."""

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        return [window] * config.num_hidden_layers
