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
``E = -log(u)``. A row therefore depends on its key alone, and the native kernel
(``kernels/csrc/race_cpu.c``) generates it inside the argmax pass, with no
``[rows, vocab]`` noise tensor: the race's noise had been most of a sampled decode
step's sampler time (docs/benchmarks.md). This module's torch implementation is the
reference, and the path of GPUs and of hosts without the native library.

:func:`sample_race_logits` races logits at a temperature without a probability tensor:
``w = exp((l - max) / T)`` is the softmax without its normaliser ``Z``, a common factor
of the row's ``w / E`` that cannot move the argmax, so it draws what racing the softmax
draws (a float near-tie aside) while skipping the softmax's pass and its ``[rows, vocab]``
output; the native kernel computes ``w`` chunk by chunk inside the race.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.kernels import cpu_ext

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32's multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # and its key increments ("Weyl" constants)
_LOW32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
#: the logits' dtypes :func:`sample_race_logits` races (each widens to float32 exactly)
_RACE_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


#: the independent streams of unseeded rows' keys (:func:`key_generator`)
SAMPLER_STREAM = 0
DRAFT_STREAM = 1


def key_generator(seed: int, stream: int) -> np.random.Generator:
    """The generator of unseeded rows' keys for one consumer of an engine's seed.

    The target's sampler and a draft model are seeded alike (``ModelConfig.seed``) but
    must not draw with the same keys: speculative sampling is exact only when the draft
    token's noise is independent of the noise that draws the target's token (a shared
    key made a draft and the token after it agree far more often than the distributions
    say). Each consumer gets its own child of ``SeedSequence(seed)`` (NumPy's way to
    derive independent streams from one seed).

    Args:
        seed: the engine's seed (>= 0).
        stream: ``SAMPLER_STREAM`` or ``DRAFT_STREAM``.

    Returns:
        A PCG64 generator for :func:`row_keys`.
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(stream,))))


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


def _mulhilo32(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``m * c`` (``m``, ``c`` in ``[0, 2**32)``), in
    int64 without overflow: ``c`` is split into 16-bit halves."""
    a = m * (c & 0xFFFF)  # < 2**48
    b = m * (c >> 16)  # < 2**48; m * c = b * 2**16 + a
    return (b + (a >> 16)) >> 16, (((b & 0xFFFF) << 16) + a) & _LOW32


def philox4x32_10(counters: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 of counters ``(c, 0, 0, 0)``, in torch int64 ops on ``keys``'
    device (the reference of the native kernel, and its stand-in on GPUs and on hosts
    without the native library).

    Args:
        counters: ``[n]`` int64 in ``[0, 2**32)``.
        keys: ``[rows]`` int64, each the 64-bit pattern of a key ``(K mod 2**32, K >> 32)``.

    Returns:
        ``[rows, n, 4]`` int64 in ``[0, 2**32)``, the four output words per counter.
    """
    k0 = (keys & _LOW32).unsqueeze(1)
    k1 = ((keys >> 32) & _LOW32).unsqueeze(1)
    c0 = counters.to(keys.device).unsqueeze(0).expand(keys.shape[0], -1)
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_M0, c0)
        hi1, lo1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _LOW32
        k1 = (k1 + _W1) & _LOW32
    return torch.stack([c0, c1, c2, c3], dim=-1)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """``(bits >> 9) * 2**-23 + 2**-24``: 32-bit words (int64 in ``[0, 2**32)``) to
    float32 uniforms in ``[2**-24, 1 - 2**-24]``, each an odd multiple of ``2**-24``
    (exact in float32; a 24-bit mapping would round its largest values to 1.0, whose
    ``-log`` is 0)."""
    return (bits >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The race's Exp(1) noise of each row's key, on ``keys``' device (the reference of
    the native kernel's, far slower than the kernel's whole draw on the CPU: the
    fallback for GPUs and hosts without the native library; docs/benchmarks.md).

    Args:
        keys: ``[rows]`` int64 from :func:`row_keys`.
        vocab: entries per row, >= 1.

    Returns:
        ``[rows, vocab]`` float32, every value in ``[5.9e-8, 16.7]``.

    Raises:
        ValueError: ``vocab`` < 1.
    """
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    blocks = torch.arange((vocab + 3) // 4, dtype=torch.int64)
    bits = philox4x32_10(blocks, keys).reshape(keys.shape[0], -1)[:, :vocab]
    return uniform_from_bits(bits).log_().neg_()


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

    Raises:
        ValueError: ``weights`` not 2-D, or ``keys`` not ``[num_rows]`` int64.
    """
    if weights.dim() != 2:
        raise ValueError(f"sample_race: weights must be 2-D, got {tuple(weights.shape)}")
    cpu_ext.check_row_vectors("sample_race", weights.shape[0], False, keys=(keys, torch.int64))
    if weights.device.type == "cpu":
        native = cpu_ext.race_rows_cpu(weights, keys)
        if native is not None:
            return native
    noise = race_noise(keys.to(weights.device), weights.shape[1])
    return (weights / noise).argmax(dim=-1)


def race_weights(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The weights :func:`sample_race_logits` races (the reference of the native
    kernel's): ``exp((l - m) * (1 / T))`` per row, ``m`` the row's maximum, and 0 where
    that exponent is below ``cpu_ext.RACE_MIN_EXPONENT`` (-80): -inf (a masked token)
    among them, and weights under e^-80, which could not beat the maximum's 1 anyway.
    A row of -inf only takes ``m = 0``, so every weight is 0.

    Args:
        logits: ``[rows, vocab]`` float32, bfloat16 or float16 (widened exactly), finite
            or -inf.
        temperatures: ``[rows]`` float32, each finite and > 0, on ``logits``' device.

    Returns:
        ``[rows, vocab]`` float32 in ``[0, 1]``, 1 at each row's maximum (a row of -inf
        only: all 0).
    """
    x = logits.float()
    m = x.amax(dim=-1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)
    # NOTE: times the float32 reciprocal, as the kernel computes it (one rounding of 1/T).
    z = (x - m).mul_(temperatures.reciprocal().unsqueeze(1))
    return z.exp().masked_fill_(z < cpu_ext.RACE_MIN_EXPONENT, 0.0)


def sample_race_logits(
    logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """One draw per row from ``softmax(logits / T)`` by the exponential race, without
    the softmax: ``argmax(race_weights(logits, temperatures) / noise)``, the noise that
    of each row's key (the same stream as :func:`sample_race`'s).

    Args:
        logits: ``[num_rows, vocab]`` float32 or bfloat16 (read as they are: no float32
            copy on the CPU), or float16 (a ``dtype="float16"`` model's; raced as its
            exact float32 widening, a copy), finite or -inf; not modified.
        temperatures: ``[num_rows]`` float32, each finite and > 0 (any device).
        keys: ``[num_rows]`` int64 from :func:`row_keys`.

    Returns:
        ``[num_rows]`` int64 indices on ``logits``' device; a -inf logit is never
        returned unless the whole row is -inf (then index 0, as :func:`sample_race`
        returns for a row of zeros).

    Raises:
        ValueError: ``logits`` not 2-D float32 / bfloat16 / float16, ``temperatures``
            not ``[num_rows]`` float32 of finite values > 0, or ``keys`` not
            ``[num_rows]`` int64.
    """
    if logits.dim() != 2 or logits.dtype not in _RACE_LOGIT_DTYPES:
        raise ValueError(f"sample_race_logits: logits must be 2-D float32, bfloat16 or "
                         f"float16, got {tuple(logits.shape)} {logits.dtype}")
    if logits.dtype == torch.float16:
        # NOTE: the native kernel reads float32 and bfloat16 only; float16 widens to
        # float32 exactly, so the draw is the float32 logits' draw on every path.
        logits = logits.float()
    cpu_ext.check_row_vectors("sample_race_logits", logits.shape[0], False,
                              temperatures=(temperatures, torch.float32),
                              keys=(keys, torch.int64))
    # the smallest normal float32: 1 / T stays finite
    if not bool(((temperatures >= torch.finfo(torch.float32).tiny)
                 & (temperatures < float("inf"))).all()):
        raise ValueError(f"sample_race_logits: temperatures must be finite and > 0, got "
                         f"{temperatures.tolist()}")
    if logits.device.type == "cpu":
        native = cpu_ext.race_logits_rows_cpu(logits, temperatures.cpu(), keys.cpu())
        if native is not None:
            return native
    return sample_race(race_weights(logits, temperatures.to(logits.device)), keys)
