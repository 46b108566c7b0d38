"""Qwen3 (Qwen team 2025): Llama with per-head RMSNorm on queries and keys before RoPE.

``config.attention_bias`` (default False) controls the projection biases.
"""

from __future__ import annotations

from tandem.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama + ``q_norm`` / ``k_norm`` over ``head_dim``."""

    qk_norm = True
