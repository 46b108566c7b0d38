"""Native CPU kernels (``kernels/csrc/*.c``): the op wrappers over the loaded library.

Kernels: paged decode attention, bf16 prefill attention, fused residual add +
RMSNorm, rotary embedding, SiLU-and-multiply, the cache write, row argmax, and
bf16 linear layers on packed weights (the bf16 kernels on AMX tiles where the
CPU has them, else AVX512-BF16). Each wrapper declines (``supports`` is False or
it returns ``None``) where it cannot serve the tensors, and the torch reference
runs.

Why a C kernel: paged decode attention is memory bound, and the torch path has to
gather every context block into a padded copy before SDPA can run (see
``kernels/attention.py``); ``paged_decode_attention_cpu`` reads K/V in place.

Which build of the library runs (one per ISA variant, ``kernels/native_build.py``)
and whether one runs at all is decided by ``kernels/backend.py``; the functions
and their argument lists come from ``csrc/tandem_kernels.h``
(``kernels/native_abi.py``).
"""

from __future__ import annotations

import torch

from tandem.kernels import backend
from tandem.kernels.host_memory import empty_huge_page_tensor
from tandem.kernels.native_abi import ABI, NativeLibrary

# Limits compiled into the kernels (stack scratch per work item), from the header.
MAX_HEADS = ABI.constants["TANDEM_MAX_HEADS"]
MAX_GROUP = ABI.constants["TANDEM_MAX_GROUP"]  # query heads per KV head
MAX_HEAD_DIM = ABI.constants["TANDEM_MAX_HEAD_DIM"]
MAX_HIDDEN = ABI.constants["TANDEM_MAX_HIDDEN"]  # row length of the fused RMSNorm
VECTOR_WIDTH = ABI.constants["TANDEM_VECTOR_WIDTH"]  # floats per vector; head_dim % it == 0


def load() -> NativeLibrary | None:
    """The selected native library (``backend.current().native()``), or ``None``
    when disabled or unbuildable."""
    return backend.current().native()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention_cpu`` can serve these tensors."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16):
        return False
    num_heads, head_dim = q.shape[1], q.shape[2]
    return (
        num_heads <= MAX_HEADS
        and num_heads // k_cache.shape[2] <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % VECTOR_WIDTH == 0
        and q.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and load() is not None
    )


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Decode attention straight from the paged cache (no gather), on the CPU.

    Args:
        q: ``[nd, num_heads, head_dim]`` float32 or bfloat16, one query token per
            sequence (its last position), last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (strided layer views are fine; last dim contiguous), ``q``'s dtype.
        block_tables: ``[nd, max_blocks]`` int64; seq_lens: ``[nd]`` int64
            context lengths in tokens, including the new token.
        scale: softmax scale; sliding_window: optional window in tokens.
        tiles: bf16 only: compute the scores on AMX tiles (``None``: where
            ``amx_available()``; ``False``: with AVX512-BF16 dot products, as on
            CPUs without AMX). Shapes those paths do not take (block_size % 16,
            head_dim % 32, more than 16 query heads per KV head) run the generic
            vector code either way.

    Returns:
        ``[nd, num_heads, head_dim]`` in ``q.dtype`` (float32 accumulation).

    Raises:
        RuntimeError: when the library is unavailable (check ``supports`` first)
            or the kernel reports an unsupported shape or allocation failure.
    """
    lib = load()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available")
    nd, num_heads, head_dim = q.shape
    out = torch.empty((nd, num_heads, head_dim), dtype=q.dtype)
    if nd == 0:
        return out
    bt = block_tables.contiguous()
    lens = seq_lens.contiguous()
    window = sliding_window if sliding_window is not None else 2**62
    on_tiles = q.dtype == torch.bfloat16 and tiles is not False and amx_available()
    rc = lib.paged_decode_attention(
        int(q.dtype == torch.bfloat16),
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        bt.data_ptr(), bt.stride(0), lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        nd, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        float(scale), window, int(on_tiles), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention_cpu failed with code {rc}")
    return out


# Below this many elements an elementwise kernel runs on the calling thread:
# waking the pool's sleeping threads (passive wait policy) costs more.
_SERIAL_NUMEL = 1 << 16


def _threads_for(numel: int) -> int:
    return 1 if numel < _SERIAL_NUMEL else torch.get_num_threads()


def _elementwise_ok(*tensors: torch.Tensor) -> bool:
    t0 = tensors[0]
    return (
        t0.device.type == "cpu"
        and t0.dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == t0.dtype and t.device == t0.device for t in tensors)
        and load() is not None
    )


def add_rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Fused ``residual add + RMSNorm`` (see ``kernels/layernorm.py`` for the math).

    Args:
        x: ``[..., hidden]`` bfloat16 (float32 is declined); weight ``[hidden]``;
            residual like ``x``.

    Returns:
        ``normed`` (no residual) or ``(normed, x + residual)``, new contiguous
        tensors; ``None`` when the native path cannot serve these tensors (the
        caller then runs the torch reference).
    """
    tensors = (x, weight) if residual is None else (x, weight, residual)
    # bf16 only: in float32 the torch path is kept bit-identical to
    # transformers (the token-for-token oracle); a C sum runs in another order.
    if x.dtype != torch.bfloat16 or not _elementwise_ok(*tensors) or not x.is_contiguous():
        return None
    if x.shape[-1] > MAX_HIDDEN:
        return None
    if residual is not None and not residual.is_contiguous():
        return None
    lib = load()
    assert lib is not None
    hidden = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    lib.add_rms_norm(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.contiguous().data_ptr(),
        out.data_ptr(),
        res_out.data_ptr() if res_out is not None else None,
        x.numel() // hidden if hidden else 0,
        hidden,
        float(eps),
        _threads_for(x.numel()),
    )
    return out if res_out is None else (out, res_out)


def rotary_neox_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotary embedding of ``x: [T, H, D]`` (head dim contiguous, any token/head
    strides) by ``cos, sin: [T, 1, D/2]``; a new contiguous ``[T, H, D]``, or
    ``None`` when the native path cannot serve these tensors."""
    if not _elementwise_ok(x, cos, sin) or x.stride(-1) != 1:
        return None
    lib = load()
    assert lib is not None
    tokens, heads, head_dim = x.shape
    cos = cos.reshape(tokens, head_dim // 2).contiguous()
    sin = sin.reshape(tokens, head_dim // 2).contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    lib.rotary_neox(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        out.data_ptr(),
        tokens,
        heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        _threads_for(out.numel()),
    )
    return out


def cache_write_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Native ``reshape_and_cache``: copy ``key/value [T, H, D]`` rows (head dim
    contiguous, any token/head strides) into the cache slots ``slot_mapping``
    (``[T]`` int64, ``block * block_size + offset``) of ``k_cache/v_cache``
    (``[blocks, block_size, H, D]`` views, head dim contiguous). Exact copies.

    Returns whether it ran (False: not servable here, use the torch path).
    """
    if not _elementwise_ok(key, value, k_cache, v_cache):
        return False
    if not (key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1):
        return False
    if not slot_mapping.is_contiguous():
        return False
    lib = load()
    assert lib is not None
    tokens, heads, head_dim = key.shape
    lib.cache_write(
        key.data_ptr(), key.stride(0), key.stride(1),
        value.data_ptr(), value.stride(0), value.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slot_mapping.data_ptr(), tokens, heads, head_dim, k_cache.shape[1],
        key.element_size(), _threads_for(2 * key.numel()),
    )  # fmt: skip
    return True


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` for ``x = [T, 2 * I]`` holding ``gate | up`` (SwiGLU,
    Shazeer 2020); ``[T, I]`` bfloat16, or ``None`` when the native path cannot
    serve ``x`` (float32 is declined, see ``add_rms_norm_cpu``)."""
    if x.dtype != torch.bfloat16 or not _elementwise_ok(x) or x.dim() != 2:
        return None  # float32: torch's exp, as transformers computes it
    if not x.is_contiguous() or x.shape[1] % 2:
        return None
    lib = load()
    assert lib is not None
    tokens, two_inter = x.shape
    out = torch.empty((tokens, two_inter // 2), dtype=x.dtype)
    lib.silu_and_mul(
        int(x.dtype == torch.bfloat16),
        x.data_ptr(),
        out.data_ptr(),
        tokens,
        two_inter // 2,
        _threads_for(x.numel()),
    )
    return out


def argmax_rows_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """Row-wise argmax of ``x [rows, cols]`` (float32 or bfloat16, unit stride in
    the last dim): ``[rows]`` int64, the first index of each row's maximum (of
    its first NaN when it has one), as ``x.max(dim=-1).indices`` returns it.

    Why: through torch the greedy sampler makes a float32 copy of the logits,
    then a max over cold rows, a large share of a small model's decode step;
    this reads the bf16 logits once with 16-lane compares. ``None`` when the native
    path cannot serve ``x`` (the caller uses torch).
    """
    if x.dim() != 2 or x.shape[1] < 1 or x.stride(1) != 1 or not _elementwise_ok(x):
        return None
    lib = load()
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(
        int(x.dtype == torch.bfloat16), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
        out.data_ptr(), _threads_for(x.numel()),
    )  # fmt: skip
    return out


def check_row_vectors(where: str, rows: int, cpu: bool,
                      **vectors: tuple[torch.Tensor, torch.dtype]) -> None:
    """Check that each named vector has one entry per row: shape ``[rows]``, its dtype,
    and, when ``cpu``, on the CPU (the per-row arguments of the race kernels).

    Raises:
        ValueError: naming ``where`` and the first vector that does not fit.
    """
    for name, (arg, dtype) in vectors.items():
        if arg.shape != (rows,) or arg.dtype != dtype or (cpu and arg.device.type != "cpu"):
            raise ValueError(f"{where}: {rows} rows need {name} of shape ({rows},) {dtype}"
                             f"{' on the CPU' if cpu else ''}, got {tuple(arg.shape)} "
                             f"{arg.dtype} on {arg.device}")


def race_rows_cpu(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """One draw per row by the exponential race, its noise generated in the kernel:
    ``argmax_i weights[r, i] / E_r[i]`` with ``E_r`` the Exp(1) stream of ``keys[r]``
    (``csrc/race_cpu.c``; the same stream as ``engine.categorical.race_noise``).

    Args:
        weights: ``[rows, cols]`` float32, CPU, finite and non-negative, unit stride in
            the last dim (probabilities or unnormalised); not modified.
        keys: ``[rows]`` int64, each row's key (any 64-bit pattern).

    Returns:
        ``[rows]`` int64, or ``None`` when the native path cannot serve the weights.

    Raises:
        ValueError: ``keys`` not ``[rows]`` int64 on the CPU.
    """
    if (
        weights.dim() != 2 or weights.shape[1] < 1 or weights.stride(1) != 1
        or weights.dtype != torch.float32 or not _elementwise_ok(weights)
    ):
        return None
    check_row_vectors("race_rows_cpu", weights.shape[0], True, keys=(keys, torch.int64))
    lib = load()
    assert lib is not None
    keys = keys.contiguous()
    out = torch.empty(weights.shape[0], dtype=torch.int64)
    lib.race_rows(
        weights.data_ptr(), weights.stride(0), weights.shape[0], weights.shape[1],
        keys.data_ptr(), out.data_ptr(), _threads_for(weights.numel()),
    )  # fmt: skip
    return out


#: exponents ``(l - max) / T`` below this get weight 0 in :func:`race_logits_rows_cpu`
RACE_MIN_EXPONENT = ABI.constants["TANDEM_RACE_MIN_EXPONENT"]


def race_logits_rows_cpu(
    logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor | None:
    """One draw per row by the exponential race from logits and a temperature, no
    probability tensor: ``argmax_i w[r, i] / E_r[i]`` with ``w = exp((l - max_r) / T_r)``
    (0 where the exponent is below ``RACE_MIN_EXPONENT``: -inf logits never win) and
    ``E_r`` the Exp(1) stream of ``keys[r]`` (``csrc/race_cpu.c``; the formula of
    ``engine.categorical.race_weights``, the noise of :func:`race_rows_cpu`).

    Args:
        logits: ``[rows, cols]`` float32 or bfloat16, CPU, unit stride in the last dim;
            finite or -inf (+inf and NaN give an unspecified index); not modified.
        temperatures: ``[rows]`` float32 on the CPU, each finite and > 0 (the values are
            not checked here: ``engine.categorical.sample_race_logits`` checks them).
        keys: ``[rows]`` int64 on the CPU, each row's key (any 64-bit pattern).

    Returns:
        ``[rows]`` int64 (index 0 for a row of -inf only), or ``None`` when the native
        path cannot serve the logits.

    Raises:
        ValueError: ``temperatures`` or ``keys`` not ``[rows]`` float32 / int64 on the CPU.
    """
    if logits.dim() != 2 or logits.shape[1] < 1 or logits.stride(1) != 1:
        return None
    if not _elementwise_ok(logits):
        return None
    rows = logits.shape[0]
    check_row_vectors("race_logits_rows_cpu", rows, True,
                      temperatures=(temperatures, torch.float32), keys=(keys, torch.int64))
    lib = load()
    assert lib is not None
    temperatures, keys = temperatures.contiguous(), keys.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    lib.race_logits_rows(
        int(logits.dtype == torch.bfloat16), logits.data_ptr(), logits.stride(0), rows,
        logits.shape[1], temperatures.data_ptr(), keys.data_ptr(), out.data_ptr(),
        _threads_for(logits.numel()),
    )  # fmt: skip
    return out


def race_noise_cpu(keys: torch.Tensor, cols: int) -> torch.Tensor | None:
    """The Exp(1) noise :func:`race_rows_cpu` draws with: ``[len(keys), cols]``
    float32, row r the stream of ``keys[r]`` (for tests and the reference), or
    ``None`` without the native library."""
    lib = load()
    if lib is None or cols < 1:
        return None
    if keys.dim() != 1 or keys.dtype != torch.int64 or keys.device.type != "cpu":
        raise ValueError(f"race_noise_cpu: keys must be 1-D int64 on the CPU, got "
                         f"{tuple(keys.shape)} {keys.dtype} on {keys.device}")
    keys = keys.contiguous()
    out = torch.empty(keys.shape[0], cols, dtype=torch.float32)
    lib.race_noise(keys.data_ptr(), keys.shape[0], cols, out.data_ptr(),
                   _threads_for(out.numel()))
    return out


def amx_available() -> bool:
    """Whether the AMX tile paths can run here: a build for a CPU with AMX-BF16
    and the tile state granted to this process by Linux (asked once per library)."""
    lib = load()
    return lib is not None and lib.tiles_available


LINEAR_NONE = ABI.constants["TANDEM_LINEAR_NONE"]
LINEAR_FMA = ABI.constants["TANDEM_LINEAR_FMA"]  # AVX2 + FMA, weights widened in registers
LINEAR_BF16 = ABI.constants["TANDEM_LINEAR_BF16"]  # AVX512-BF16 (and AMX tiles)


def bf16_linear_path() -> int:
    """Which path runs the packed linear kernels here (``csrc/bf16_linear_cpu.c``):
    ``LINEAR_BF16`` (a build for a CPU with AVX512-BF16, on AMX tiles where
    ``amx_available()``), ``LINEAR_FMA`` (AVX2 + FMA: ``bf16_linear`` and
    ``bf16_linear_argmax`` only, no fused SwiGLU) or ``LINEAR_NONE``."""
    lib = load()
    return LINEAR_NONE if lib is None else int(lib.bf16_linear_path())


def bf16_linear_available() -> bool:
    """Whether the AVX512-BF16 linear kernels (fused SwiGLU included) run here."""
    return bf16_linear_path() == LINEAR_BF16


def bf16_linear_supports(out_features: int, in_features: int, path: int = LINEAR_BF16) -> bool:
    """Whether ``bf16_linear`` takes a ``[out_features, in_features]`` weight on this
    machine with kernel path ``path`` (``bf16_linear_path()``'s values)."""
    return in_features % 32 == 0 and out_features % 16 == 0 and bf16_linear_path() == path


def bf16_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a bf16 ``[N, K]`` weight into the VNNI tiles the bf16 linear kernels
    read (see ``csrc/bf16_linear_cpu.c``): a flat ``[N * K]`` bf16 tensor. Needs
    ``N % 16 == 0``, ``K % 32 == 0`` and a ``bf16_linear_path()`` other than
    ``LINEAR_NONE``.

    Raises:
        ValueError: on a shape or dtype the kernel does not take, or a build with
            neither AVX512-BF16 nor AVX2 + FMA.
    """
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 16 or k % 32 or bf16_linear_path() == LINEAR_NONE:
        raise ValueError(
            f"bf16 packing needs a bf16 [N % 16, K % 32] weight and a CPU with "
            f"AVX512-BF16 or AVX2 + FMA, got {weight.dtype} {tuple(weight.shape)}"
        )
    lib = load()
    assert lib is not None
    w = weight.detach().contiguous()
    # streamed from memory at every decode step: huge pages save the page walks
    packed = empty_huge_page_tensor((n * k,), torch.bfloat16)
    lib.bf16_pack_weight(w.data_ptr(), n, k, packed.data_ptr())
    return packed


def _on_tiles(tiles: bool | None) -> bool:
    """``tiles`` resolved (``None``: where ``amx_available()``).

    Raises:
        RuntimeError: ``tiles=True`` without AMX here.
    """
    if tiles is None:
        return amx_available()
    if tiles and not amx_available():
        raise RuntimeError("tiles=True needs AMX-BF16 (see amx_available)")
    return tiles


def bf16_linear_swiglu(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    tiles: bool | None = None,
) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection in one pass:
    ``silu(x @ Wg.T + bg) * (x @ Wu.T + bu)`` where ``W = [Wg; Wu]`` is
    ``[out_features, K]`` packed by ``bf16_pack_weight``.

    Args:
        x: ``[M, K]`` bf16, unit stride in the last dim; bias: ``[out_features]``
            bf16 or ``None``; ``out_features % 32 == 0``.
        tiles: on AMX tiles (``None``: where ``amx_available()``), else VDPBF16PS.

    Returns:
        ``[M, out_features // 2]`` bf16, bit-identical to ``bf16_linear`` (same
        ``tiles``) followed by ``silu_and_mul_cpu``.

    Raises:
        ValueError: on an argument of the wrong dtype, shape or stride.
        RuntimeError: when the kernel rejects the shapes, ``tiles=True`` without AMX,
            or a path other than ``LINEAR_BF16`` (``bf16_linear_available()``).
    """
    y = torch.empty((x.shape[0], out_features // 2), dtype=torch.bfloat16)
    return _linear_call("bf16_linear_swiglu", tiles, x, packed, bias, out_features, y, y.shape[1])


def _check_linear_args(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> None:
    """The shapes, dtypes and strides the linear kernels read, checked before any
    pointer reaches C.

    Raises:
        ValueError: naming the argument that does not fit.
    """
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(
            f"x must be a [M, K] bf16 CPU tensor with unit stride in K, got {x.dtype} "
            f"{tuple(x.shape)} strides {x.stride()} on {x.device}"
        )
    if x.shape[0] < 1:
        raise ValueError("x must have at least one row")
    if packed.dtype != torch.bfloat16 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous bf16 tensor, got {packed.dtype}")
    if packed.numel() != out_features * x.shape[1]:
        raise ValueError(
            f"packed holds {packed.numel()} elements, not out_features x K = "
            f"{out_features} x {x.shape[1]}"
        )
    if bias is not None and (
        bias.dtype != torch.bfloat16 or bias.numel() != out_features or not bias.is_contiguous()
    ):
        raise ValueError(
            f"bias must be a contiguous bf16 [{out_features}] tensor, got {bias.dtype} "
            f"{tuple(bias.shape)}"
        )


def _linear_call(
    name: str,
    tiles: bool | None,
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    out: torch.Tensor,
    *out_args: int,
) -> torch.Tensor:
    """Call linear kernel ``name`` (tiles, x, its row stride, weight, bias, out,
    *out_args, M, N, K, threads) and return ``out``; raises RuntimeError on a
    non-zero code."""
    _check_linear_args(x, packed, bias, out_features)
    on_tiles = _on_tiles(tiles)
    lib = load()
    assert lib is not None
    m, k = x.shape
    rc = getattr(lib, name)(
        int(on_tiles), x.data_ptr(), x.stride(0), packed.data_ptr(),
        bias.data_ptr() if bias is not None else None, out.data_ptr(), *out_args,
        m, out_features, k, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc} for x {tuple(x.shape)}")
    return out


def bf16_linear_argmax(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    tiles: bool | None = None,
) -> torch.Tensor:
    """Row-wise argmax of ``x @ W.T + bias`` without materialising it: an LM head
    and greedy sampling in one pass (``W`` packed by ``bf16_pack_weight``).

    Why: with a large vocabulary the logits are a write and a re-read of
    megabytes per decode step (a large share of the LM head's time), only to be
    reduced to one token id per row when every request samples greedily.

    Args:
        x: ``[M, K]`` bf16, unit stride in the last dim; bias ``[N]`` bf16 or ``None``.
        tiles: on AMX tiles (``None``: where ``amx_available()``), else VDPBF16PS
            or, on the ``LINEAR_FMA`` path, float32 FMAs.

    Returns:
        ``[M]`` int64: per row the first index of the maximum of the bf16 outputs
        that ``bf16_linear`` (same ``tiles``) would return (of the first NaN where
        there is one), the same ids as ``bf16_linear(...).max(dim=-1).indices``.

    Raises:
        ValueError: on an argument of the wrong dtype, shape or stride.
        RuntimeError: when the kernel rejects the shapes or cannot allocate, or
            ``tiles=True`` without AMX.
    """
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    return _linear_call("bf16_linear_argmax", tiles, x, packed, bias, out_features, ids)


def bf16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    tiles: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` with ``W`` packed by ``bf16_pack_weight``.

    Args:
        x: ``[M, K]`` bf16, unit stride in the last dim; packed: from
            ``bf16_pack_weight``; bias: ``[N]`` bf16 or ``None``.
        tiles: on AMX tiles (``None``: where ``amx_available()``), else VDPBF16PS
            or, on the ``LINEAR_FMA`` path, float32 FMAs (other summation orders).

    Returns:
        ``[M, N]`` bf16 (float32 accumulation, one rounding).

    Raises:
        ValueError: on an argument of the wrong dtype, shape or stride.
        RuntimeError: when the kernel rejects the shapes, or ``tiles=True`` without AMX.
    """
    y = torch.empty((x.shape[0], out_features), dtype=torch.bfloat16)
    return _linear_call("bf16_linear", tiles, x, packed, bias, out_features, y, out_features)


def prefill_attention_supports(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether ``prefill_attention_cpu`` serves this query and these cache views: bf16
    on a CPU with AVX512-BF16 (AMX optional), head_dim % 32 == 0 and <= 256."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    lib = load()
    return (
        query.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and v_cache.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and head_dim % 32 == 0
        and head_dim <= 256
        and num_heads % k_cache.shape[2] == 0
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
        # K rows are read as 32-bit pairs (and gathered with stride sk_o / 2)
        and all(st % 2 == 0 for st in k_cache.stride()[:3])
        and k_cache.data_ptr() % 4 == 0
        and lib is not None
        and bool(lib.prefill_attention_bf16_available())
    )


def prefill_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    desc: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    tiles: bool | None = None,
) -> None:
    """Causal attention of every prefill sequence in one native call, K/V read from
    the paged cache (the new tokens' K/V must be written there first); see
    ``csrc/prefill_attention_cpu.c`` for the algorithm. Needs
    ``prefill_attention_supports``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` bf16, head dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` bf16
            views (any block / offset / head strides).
        desc, tables: ``AttentionMetadata.prefill_descriptors()``.
        scale: softmax scale; sliding_window: in tokens, or ``None``.
        out: ``[num_tokens, num_heads, head_dim]`` bf16; the prefill rows are written.
        tiles: the products on AMX tiles (``None``: where ``amx_available()``;
            ``False``: AVX512-BF16 dot products, for tests on AMX machines).

    Raises:
        RuntimeError: ``tiles=True`` without AMX here, or when the kernel rejects
            the shapes or cannot allocate.
    """
    on_tiles = _on_tiles(tiles)
    lib = load()
    assert lib is not None
    num_heads, head_dim = query.shape[1], query.shape[2]
    rc = lib.prefill_attention_bf16(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        desc.data_ptr(), tables.data_ptr(), desc.shape[0],
        out.data_ptr(), out.stride(0), out.stride(1),
        num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        float(scale), int(sliding_window or 0), int(on_tiles), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"prefill_attention_bf16 failed with code {rc}")
