"""Qwen2 (Yang et al. 2024): the Llama architecture with a bias on the Q/K/V projections.

Sliding-window layers, when the config enables them, come from ``config.layer_types``.
"""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama + ``qkv_proj`` bias."""

    qkv_bias = True
