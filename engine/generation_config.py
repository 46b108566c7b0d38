"""The model's default sampling values: what a request that leaves a field unset gets.

vLLM's ``--generation-config`` (default ``auto``): the model folder's
``generation_config.json`` (Hugging Face's ``GenerationConfig`` file) may set
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens``; those become the defaults of requests that do not set the field
(``max_new_tokens`` that of ``max_tokens``). A field the request sets always wins.
``vllm`` ignores the file (the OpenAI API's own defaults); a folder path reads the
file from there instead. A GGUF model carries no generation config: its defaults are
the API's.

Read with ``json`` alone: the router that applies these loads no torch and no
transformers model classes.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from tandem.engine.sampling_params import SamplingDefaults, SamplingParams
from tandem.engine.validation import RequestError

FILE_NAME = "generation_config.json"


def load_sampling_defaults(generation_config: str, model_folder: str | None) -> SamplingDefaults:
    """The defaults ``--generation-config`` selects.

    Args:
        generation_config: ``auto`` (``model_folder``'s file), ``vllm`` (none), or a
            folder holding a ``generation_config.json``.
        model_folder: the model's folder (``None`` for a GGUF file: no generation config).

    Returns:
        The API's defaults where the file is absent or sets none of the fields.

    Raises:
        ValueError: a folder given explicitly without the file, a file that is not a JSON
            object, or a value out of range, naming the file and the field.
    """
    if generation_config == "vllm":
        return SamplingDefaults()
    if generation_config == "auto":
        if model_folder is None:
            return SamplingDefaults()
        path = os.path.join(model_folder, FILE_NAME)
        if not os.path.isfile(path):
            return SamplingDefaults()
    else:
        path = os.path.join(generation_config, FILE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config: {path} does not exist (give 'auto', "
                             "'vllm' or a folder with a generation_config.json)")
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return _from_mapping(raw, path)


def _from_mapping(raw: dict[str, Any], path: str) -> SamplingDefaults:
    values: dict[str, Any] = {}
    for key, name, kind in (("temperature", "temperature", float), ("top_p", "top_p", float),
                            ("top_k", "top_k", int), ("min_p", "min_p", float),
                            ("repetition_penalty", "repetition_penalty", float),
                            ("max_new_tokens", "max_tokens", int)):
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or (
                kind is int and not float(v).is_integer()) or not math.isfinite(v):
            raise ValueError(f"{path}: {key} must be a finite {kind.__name__}, got {v!r}")
        values[name] = kind(v)
    # transformers writes its own default top_k (50) into files it saves; vLLM reads the
    # file's difference from those defaults, so 50 is not applied there either; 0 is
    # transformers' "no top-k"
    if values.get("top_k") in (0, 50):
        values.pop("top_k")
    try:
        SamplingParams(**values)  # the ranges are SamplingParams' rules
    except RequestError as exc:
        key = "max_new_tokens" if exc.field == "max_tokens" else exc.field
        raise ValueError(f"{path}: {key}: {exc}") from exc
    return SamplingDefaults(**values, source=path)
