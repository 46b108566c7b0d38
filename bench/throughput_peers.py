"""The peers `tandem bench throughput` runs beside tandem: transformers ``generate`` in
static batches and llama.cpp (llama-cpp-python) on the same GGUF file."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

# llama-cpp-python builds llama.cpp from source on install (minutes), so it is an
# optional extra rather than a dependency: only this backend needs it.
LLAMA_CPP_MISSING = (
    "--backend llama.cpp needs llama-cpp-python, which is not installed: "
    "pip install 'tandem-serve[bench]' (from a checkout: pip install -e '.[bench]')"
)

#: one timed pass: the prompts -> output tokens generated
RunOne = Callable[[list[list[int]]], int]


def _resolve_dtype(dtype: str, device: str = "cpu") -> Any:
    import torch

    if dtype == "auto":
        from tandem.engine.model_loader import resolve_dtype

        return resolve_dtype("auto", device)
    return getattr(torch, dtype)


def _hf_model_args(model: str | None) -> tuple[str, dict[str, Any]]:
    from tandem.engine.model_files import default_model_path

    path = model or default_model_path()
    if path.endswith(".gguf"):
        return os.path.dirname(path), {"gguf_file": os.path.basename(path)}
    return path, {}


def run_hf(
    args: argparse.Namespace, prompt_sets: list[list[list[int]]]
) -> tuple[RunOne, dict[str, Any]]:
    """Load the transformers model and warm it up; returns the timed pass and metadata."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, extra = _hf_model_args(args.model)
    device = getattr(args, "device", "cpu")
    dtype = _resolve_dtype(args.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval().to(device)

    def generate(batch: list[list[int]], new_tokens: int) -> int:
        ids = torch.tensor(batch, device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=0,
        )
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    bs = args.hf_batch_size

    def run_one(prompts: list[list[int]]) -> int:
        with torch.inference_mode():
            return sum(
                generate(prompts[i : i + bs], args.output_len) for i in range(0, len(prompts), bs)
            )

    with torch.inference_mode():
        generate([prompt_sets[0][0][:16]], 4)
    return run_one, {"dtype": str(dtype).removeprefix("torch."), "batch_size": bs}


def _cpu_has_amx() -> bool:
    from tandem.kernels.backend import read_cpu_flags

    return "amx_int8" in read_cpu_flags()


@contextlib.contextmanager
def _llama_cpp_without_extra_buffers() -> Iterator[bool]:
    """Load llama.cpp models with ``use_extra_bufts = False`` on AMX CPUs.

    Why: on AMX machines ggml repacks quantized weights into its AMX buffer
    type, and there its batched matmul dies with a general protection fault on
    some (virtualized) Sapphire/Granite Rapids hosts, ours included
    (ggml-org/llama.cpp#20824; Ollama's and DSPy's CI hit it too). Q4_1, the
    default model's type, has no other repacked layout, so this only turns the
    AMX path off. Yields whether it did.
    """
    if not _cpu_has_amx():
        yield False
        return
    import llama_cpp.llama as high_level

    low = high_level.llama_cpp
    default_params = low.llama_model_default_params

    def no_extra_buffers() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = no_extra_buffers
    try:
        yield True
    finally:
        low.llama_model_default_params = default_params


def run_llama_cpp(
    args: argparse.Namespace, prompt_sets: list[list[list[int]]]
) -> tuple[RunOne, dict[str, Any]]:
    """Load llama.cpp on the GGUF and warm it up; returns the timed pass and metadata.

    Raises ImportError (naming the ``bench`` extra) when llama-cpp-python is not
    installed, ValueError when ``--model`` is not a ``.gguf`` file.
    """
    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise ImportError(LLAMA_CPP_MISSING) from e

    from tandem.engine.model_files import default_model_path

    path = args.model or default_model_path()
    if not path.endswith(".gguf"):
        raise ValueError("--backend llama.cpp needs a .gguf --model")
    threads = args.threads or os.cpu_count()
    with _llama_cpp_without_extra_buffers() as amx_off:
        llm = Llama(
            model_path=path,
            n_ctx=args.input_len + args.output_len + 16,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def generate(prompt: list[int], new_tokens: int) -> int:
        llm.reset()
        n = 0
        # temp=0: greedy; generate() never stops by itself (EOS is ignored here).
        for _ in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
            n += 1
            if n == new_tokens:
                break
        return n

    generate(prompt_sets[0][0][:16], 4)

    def run_one(prompts: list[list[int]]) -> int:
        return sum(generate(p, args.output_len) for p in prompts)

    return run_one, {"dtype": "gguf (its quantization)", "ggml_amx_buffers": not amx_off}
