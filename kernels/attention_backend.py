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


#: Most bytes of float32 attention scores one SDPA call of a tiled prefill may hold
#: (``plan_prefill_attention``): a prefill whose whole score matrix would be larger runs
#: in query tiles. 256 MiB: one 32k-token context with 32 query heads takes 64 queries a
#: call; below ~2k-token contexts a 2,048-token chunk still takes one call.
PREFILL_SCORE_BUDGET_BYTES = 256 << 20
#: Bytes of one attention score of SDPA's math kernel (it computes in float32).
SCORE_BYTES = 4


class PrefillPath(enum.Enum):
    """How a prefill (a multi-token query of one sequence) runs through SDPA.

    * ``FLASH_CAUSAL``: one call, ``is_causal`` and ``enable_gqa``: FlashAttention, which
      never materialises the score matrix (CUDA, fp16/bf16, no mask: a fresh prompt
      without a prefix or a window cut).
    * ``TILED``: the query heads sharing a KV head are folded onto the query axis (no
      ``enable_gqa``, no K/V repeat: then SDPA's memory-efficient kernel takes the mask,
      float32 included, where FlashAttention cannot), with an explicit causal / window
      mask, in query tiles whose score matrix fits ``PREFILL_SCORE_BUDGET_BYTES``: even
      SDPA's math kernel, the fallback of any other case, then holds a bounded matrix.
      Every CUDA or other-device prefill that ``FLASH_CAUSAL`` does not take.
    * ``CPU_SDPA``: one SDPA call per sequence as it stands (the CPU's SDPA kernel tiles
      masked attention itself; the CPU's bf16 prefills mostly run the native kernel).
    """

    FLASH_CAUSAL = "flash_causal"
    TILED = "tiled"
    CPU_SDPA = "cpu_sdpa"


@dataclass(frozen=True)
class PrefillPlan:
    """The outcome of ``plan_prefill_attention``.

    Attributes:
        path: how the prefill runs.
        query_tile: query tokens per SDPA call.
        num_calls: SDPA calls for the prefill's queries.
        score_bytes: the largest float32 score matrix one call may materialise, bytes
            (``num_heads * query_tile * num_keys * 4``; 0 for ``FLASH_CAUSAL``).
        peak_bytes: upper estimate of the temporaries of the prefill's attention in one
            layer, bytes: the keys and values gathered from the cache and their
            head-major copies, the query tile's copy and output, the tile's mask (bool and
            the float bias SDPA makes of it) and, for the math kernel, the scores and
            their softmax. What the memory profile adds for a prefill it did not run.
    """

    path: PrefillPath
    query_tile: int
    num_calls: int
    score_bytes: int
    peak_bytes: int


def plan_prefill_attention(
    device_type: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    num_queries: int,
    num_keys: int,
    masked: bool,
    flash: bool,
    score_budget_bytes: int = PREFILL_SCORE_BUDGET_BYTES,
) -> PrefillPlan:
    """How one prefill's attention runs, and what its temporaries may take.

    Args:
        device_type: the tensors' device type ("cuda", "cpu", ...).
        num_heads / num_kv_heads: query and KV heads of this rank (GQA: a multiple).
        head_dim: head size; elem_bytes: bytes of the model's dtype (2 or 4).
        num_queries: the prefill's new tokens.
        num_keys: the keys they attend to (cached prefix and new tokens, after any
            sliding-window cut).
        masked: the prefill needs an explicit mask (a cached prefix, a later chunk, a
            sliding window shorter than the sequence): ``prefill_mask`` is not ``None``.
        flash: SDPA's FlashAttention takes this model's prefills
            (``AttentionChoice.prefill_flash``: CUDA, fp16/bf16, a head size it takes).
        score_budget_bytes: most float32 score bytes per SDPA call of a ``TILED`` plan.

    Returns:
        The ``PrefillPlan``: ``FLASH_CAUSAL`` for an unmasked prefill FlashAttention
        takes, ``CPU_SDPA`` on the CPU, else ``TILED`` with the largest query tile
        whose score matrix fits the budget (at least one query).

    Raises:
        ValueError: a count below 1 (``num_keys`` below ``num_queries`` included),
            ``num_heads`` not a multiple of ``num_kv_heads``, or a budget below 1.
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("elem_bytes", elem_bytes),
                        ("num_queries", num_queries), ("score_budget_bytes", score_budget_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if num_keys < num_queries:
        raise ValueError(f"num_keys ({num_keys}) must be >= num_queries ({num_queries})")
    group = num_heads // num_kv_heads
    kv_copies = 4 * num_keys * num_kv_heads * head_dim * elem_bytes  # gathered + head-major
    if device_type == "cuda" and flash and not masked:
        q_and_out = 2 * num_queries * num_heads * head_dim * elem_bytes
        return PrefillPlan(PrefillPath.FLASH_CAUSAL, num_queries, 1, 0, kv_copies + q_and_out)
    per_query = num_heads * num_keys * SCORE_BYTES
    tile = num_queries if device_type == "cpu" else max(1, min(
        num_queries, score_budget_bytes // per_query))
    score = per_query * tile
    mask = group * tile * num_keys * (1 + 2 * elem_bytes)  # bool, float bias, padded copy
    q_and_out = 2 * tile * num_heads * head_dim * elem_bytes
    path = PrefillPath.CPU_SDPA if device_type == "cpu" else PrefillPath.TILED
    return PrefillPlan(path, tile, -(-num_queries // tile), score,
                       kv_copies + q_and_out + mask + 2 * score)
