"""Native CPU sampling wrappers: row-wise argmax (greedy, ``csrc/sampling_cpu.c``) and
the exponential race, one draw per row with its Exp(1) noise generated in the kernel
from each row's key, from weights or from logits and a temperature
(``csrc/race_cpu.c``; the same streams as ``engine.categorical``).
"""

from __future__ import annotations

import torch

from tandem.kernels.cpu_native import elementwise_ok, load, threads_for
from tandem.kernels.native_abi import ABI


def argmax_rows_cpu(x: torch.Tensor) -> torch.Tensor | None:
    """Row-wise argmax of ``x [rows, cols]`` (float32 or bfloat16, unit stride in
    the last dim): ``[rows]`` int64, the first index of each row's maximum (of
    its first NaN when it has one), as ``x.max(dim=-1).indices`` returns it.

    Why: through torch the greedy sampler makes a float32 copy of the logits,
    then a max over cold rows, a large share of a small model's decode step;
    this reads the bf16 logits once with 16-lane compares. ``None`` when the native
    path cannot serve ``x`` (the caller uses torch).
    """
    if x.dim() != 2 or x.shape[1] < 1 or x.stride(1) != 1 or not elementwise_ok(x):
        return None
    lib = load()
    assert lib is not None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows(
        int(x.dtype == torch.bfloat16), x.data_ptr(), x.stride(0), x.shape[0], x.shape[1],
        out.data_ptr(), threads_for(x.numel()),
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
        or weights.dtype != torch.float32 or not elementwise_ok(weights)
    ):
        return None
    check_row_vectors("race_rows_cpu", weights.shape[0], True, keys=(keys, torch.int64))
    lib = load()
    assert lib is not None
    keys = keys.contiguous()
    out = torch.empty(weights.shape[0], dtype=torch.int64)
    lib.race_rows(
        weights.data_ptr(), weights.stride(0), weights.shape[0], weights.shape[1],
        keys.data_ptr(), out.data_ptr(), threads_for(weights.numel()),
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
    if not elementwise_ok(logits):
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
        threads_for(logits.numel()),
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
                   threads_for(out.numel()))
    return out
