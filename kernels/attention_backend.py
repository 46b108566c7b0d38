"""Which paged-attention implementation a model runs, chosen once per platform.

vLLM picks an attention backend per platform, dtype and head size when the model
is loaded (``vllm/platforms/*.get_attn_backend_cls``); this is that decision for our
three implementations (``kernels/attention.py``):

* ``CPU_NATIVE``: the CPU path (``paged_attention_cpu``): the native decode and
  prefill kernels of ``kernels/csrc`` where they serve the tensors, else SDPA;
* ``TRITON_PAGED``: the Triton decode kernel straight from the KV blocks, prefills
  by SDPA (``paged_attention_triton``); the one CUDA graphs capture;
* ``TORCH_SDPA``: gather + ``scaled_dot_product_attention`` for both groups
  (``paged_attention_ref``): any device torch runs on.

On CUDA, SDPA dispatches prefills to its FlashAttention kernel where torch has it
and the dtype and head size fit (fp16/bf16, head_dim a multiple of 8 up to 256);
the choice reports whether that holds (``AttentionChoice.prefill_flash``). The
separate ``flash-attn`` package is not used: SDPA carries the same kernel.

``choose_attention_backend`` is a pure function of explicit facts (tested on the
CPU for every platform); ``detect_attention_facts`` reads them off this process.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass

import torch

#: Largest head size the Triton decode kernel is built for: it keeps a
#: ``[G, head_dim]`` query tile and ``[block_size, head_dim]`` K/V tiles in registers.
TRITON_MAX_HEAD_DIM = 256
#: SDPA's FlashAttention kernel: head sizes up to 256 in multiples of 8, half types.
FLASH_MAX_HEAD_DIM = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


class AttentionBackend(enum.Enum):
    """A paged-attention implementation (see the module docstring)."""

    CPU_NATIVE = "cpu_native"
    TRITON_PAGED = "triton_paged"
    TORCH_SDPA = "torch_sdpa"


@dataclass(frozen=True)
class AttentionFacts:
    """What the choice reads about the process, detected once.

    Attributes:
        triton: the ``triton`` package is importable.
        sdpa_flash: torch was built with SDPA's FlashAttention kernel and it is enabled
            (``torch.backends.cuda``); ``False`` off CUDA builds.
    """

    triton: bool
    sdpa_flash: bool


@dataclass(frozen=True)
class AttentionChoice:
    """The outcome of ``choose_attention_backend``.

    Attributes:
        backend: the implementation every attention layer runs.
        prefill_flash: prefills run SDPA's FlashAttention kernel (CUDA, fp16/bf16,
            a head size it takes); else another SDPA kernel or the CPU's.
        reason: why, in words (logged at start-up).
    """

    backend: AttentionBackend
    prefill_flash: bool
    reason: str


def choose_attention_backend(
    device_type: str, dtype: torch.dtype, head_dim: int, facts: AttentionFacts
) -> AttentionChoice:
    """The attention backend for a model on ``device_type`` in ``dtype`` with
    ``head_dim``-wide heads, given what the process has.

    Rules: the CPU takes ``CPU_NATIVE`` (its kernels decline what they do not serve);
    CUDA takes ``TRITON_PAGED`` where Triton is installed and ``head_dim`` is at most
    ``TRITON_MAX_HEAD_DIM``, else ``TORCH_SDPA``; any other device ``TORCH_SDPA``.

    Raises:
        ValueError: ``head_dim`` < 1 or odd (rotary embedding needs pairs).
    """
    if head_dim < 1 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if device_type == "cpu":
        return AttentionChoice(AttentionBackend.CPU_NATIVE, False, "CPU: native kernels")
    flash = (
        device_type == "cuda"
        and facts.sdpa_flash
        and dtype in FLASH_DTYPES
        and head_dim % 8 == 0
        and head_dim <= FLASH_MAX_HEAD_DIM
    )
    if device_type != "cuda":
        return AttentionChoice(AttentionBackend.TORCH_SDPA, False, f"{device_type}: SDPA")
    if not facts.triton:
        return AttentionChoice(AttentionBackend.TORCH_SDPA, flash,
                               "CUDA without triton: gather + SDPA")
    if head_dim > TRITON_MAX_HEAD_DIM:
        return AttentionChoice(
            AttentionBackend.TORCH_SDPA, flash,
            f"CUDA: head_dim {head_dim} > {TRITON_MAX_HEAD_DIM}, beyond the Triton kernel",
        )
    return AttentionChoice(AttentionBackend.TRITON_PAGED, flash,
                           "CUDA with triton: Triton paged decode, SDPA prefill")


def detect_attention_facts() -> AttentionFacts:
    """This process's ``AttentionFacts`` (imports nothing heavy; no CUDA call)."""
    flash = False
    cuda_backends = getattr(torch.backends, "cuda", None)
    if torch.version.cuda is not None and cuda_backends is not None:
        available = getattr(cuda_backends, "is_flash_attention_available", None)
        flash = bool(cuda_backends.flash_sdp_enabled()) and (
            available is None or bool(available())
        )
    return AttentionFacts(triton=importlib.util.find_spec("triton") is not None, sdpa_flash=flash)
