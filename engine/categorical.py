"""One draw per row from a categorical distribution by the exponential race.

With ``E_i ~ Exp(1)`` i.i.d., ``argmax_i(w_i / E_i)`` is index ``i`` with probability
``w_i / sum(w)`` (the Gumbel-max trick in another form). The sampler's random rows
draw this way. A small change of the weights (a KV cache recomputed after a migration,
another kernel's rounding) moves the winner only when two candidates nearly tie, so a
seeded request keeps its tokens across such paths; inverse-transform sampling, tried
instead, changed the token whenever the uniform fell within the cumulative rounding
of a boundary (14 of 2,000 seeded draws at a 1e-4 relative logit change against none for
the race; docs/benchmarks.md).

The noise is counter-based: entry ``i`` of a row with 64-bit key ``K`` comes from
Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011)
at counter ``(i // 4, 0, 0, 0)`` and key ``(K mod 2**32, K >> 32)``, word ``i % 4``;
``u = (bits >> 9) * 2**-23 + 2**-24`` (exact in float32, never 0 or 1) and
``E = -log(u)``. A row therefore depends
on its key alone, and the native kernel (``kernels/csrc/race_cpu.c``) generates it
inside the argmax pass, with no ``[rows, vocab]`` noise tensor: the race's noise had
been most of a sampled decode step's sampler time (docs/benchmarks.md). This module's
NumPy implementation is the reference and the path of hosts without the native library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.kernels import cpu_ext

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_MASK64 = (1 << 64) - 1


def row_keys(row_seeds: Sequence[int | None], shared: np.random.Generator) -> torch.Tensor:
    """Each row's noise key: its seed's (a seeded request's for this output position)
    or a fresh one from ``shared``.

    Args:
        row_seeds: per row, an int (taken modulo 2**64) or ``None``.
        shared: the generator of the unseeded rows' keys; advanced once per ``None``.

    Returns:
        ``[len(row_seeds)]`` int64 (the keys' 64-bit patterns).
    """
    fresh = iter(shared.integers(0, 1 << 64, size=sum(s is None for s in row_seeds),
                                 dtype=np.uint64).tolist())
    keys = np.array([next(fresh) if s is None else s & _MASK64 for s in row_seeds],
                    dtype=np.uint64)
    return torch.from_numpy(keys.view(np.int64))


def philox4x32_10(counters: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of counters ``(c, 0, 0, 0)``.

    Args:
        counters: ``[n]`` integers in ``[0, 2**32)``.
        keys: ``[rows]`` uint64, key ``(K mod 2**32, K >> 32)`` per row.

    Returns:
        ``[rows, n, 4]`` uint32, the four output words per counter.
    """
    keys = keys.astype(np.uint64)
    k0 = (keys & _MASK32)[:, None]
    k1 = (keys >> np.uint64(32))[:, None]
    shape = (keys.shape[0], counters.shape[0])
    c0 = np.broadcast_to(counters.astype(np.uint64)[None, :], shape)
    c1 = np.zeros(shape, np.uint64)
    c2 = np.zeros(shape, np.uint64)
    c3 = np.zeros(shape, np.uint64)
    for _ in range(10):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK32, \
            (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK32
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's Exp(1) noise of each row's key (the NumPy reference of the kernel's).

    Args:
        keys: ``[rows]`` int64 from :func:`row_keys`.
        vocab: entries per row, >= 1.

    Returns:
        ``[rows, vocab]`` float32, every value in ``[5.9e-8, 16.7]``.
    """
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    blocks = np.arange((vocab + 3) // 4, dtype=np.uint64)
    bits = philox4x32_10(blocks, keys.numpy().view(np.uint64)).reshape(len(keys), -1)[:, :vocab]
    return torch.from_numpy(-np.log(uniform_from_bits(bits)))


def uniform_from_bits(bits: np.ndarray) -> np.ndarray:
    """``(bits >> 9) * 2**-23 + 2**-24``: uint32 words to float32 uniforms in
    ``[2**-24, 1 - 2**-24]``, each an odd multiple of ``2**-24`` (exact in float32; a
    24-bit mapping would round its largest values to 1.0, whose ``-log`` is 0)."""
    return (bits >> 9).astype(np.float32) * np.float32(2.0**-23) + np.float32(2.0**-24)


def sample_race(weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``argmax(weights / noise)`` per row, the noise that of each row's key: a draw
    proportional to the weights.

    Args:
        weights: ``[num_rows, vocab]`` float32, finite and non-negative (probabilities
            or unnormalised); not modified.
        keys: ``[num_rows]`` int64 from :func:`row_keys`.

    Returns:
        ``[num_rows]`` int64 indices on ``weights``' device; a zero weight is never
        returned unless the whole row is zero (then index 0).
    """
    if weights.device.type == "cpu":
        native = cpu_ext.race_rows_cpu(weights, keys)
        if native is not None:
            return native
    noise = race_noise(keys, weights.shape[1]).to(weights.device)
    return (weights / noise).argmax(dim=-1)
