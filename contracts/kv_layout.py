"""The layout of a KV block and its fingerprint: what a block's bytes mean.

One class for engine, store and services alike: the engine describes its cache with it
(``EngineCore.layout``), the store checks block sizes with it, and its ``fingerprint``
goes into every store key (``BlockKey``) and into ``PrefillResponse`` /
``DecodeRequest.kv_layout_fingerprint``, so prefill and decode fail fast when their
layouts differ.

Two kinds of cache (``KVCacheSpec``): "mha", a K and a V of ``num_kv_heads x head_dim`` per
token and layer (every model with per-head K/V: MHA, GQA, MQA); and "mla", DeepSeek's
multi-head latent attention (DeepSeek-V2 paper, section 2.1), one entry per token and layer:
the normalised latent ``c_kv`` (``kv_lora_rank``) followed by the rotated shared key
``k_pe`` (``rope_dim``). An MLA layout's fingerprint names the kind and the split, so its
blocks never match an MHA engine's keys (a block of another layout is a miss).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields

from tandem.contracts.block_hash import BlockHash
from tandem.contracts.block_key import BlockKey

#: Bytes per element of the KV cache dtypes the engine supports.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

#: vLLM's ``--kv-cache-dtype`` choices; "fp8" is "fp8_e4m3" (vLLM's default FP8 format).
#: The engine's config validates against them and ``kernels/kv_quant.py`` maps them to torch
#: dtypes; both import them from here.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

#: Length of a layout fingerprint in bytes.
FINGERPRINT_BYTES = 16

#: The cache kinds: per-head K and V ("mha") or DeepSeek's compressed latent ("mla").
KV_KINDS: tuple[str, ...] = ("mha", "mla")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer caches per token: ``num_components`` entries of ``num_kv_heads x
    head_dim`` elements.

    Attributes:
        kind: "mha": a K and a V entry (2 components) of ``num_kv_heads`` heads of
            ``head_dim``; "mla": one entry of one "head" of ``head_dim = kv_lora_rank +
            rope_dim`` elements, the latent ``c_kv`` then the rotated ``k_pe`` (DeepSeek-V2,
            section 2.1.3; vLLM's ``kv_c_and_k_pe_cache``).
        num_kv_heads: heads per entry (1 for "mla").
        head_dim: elements per head.
        rope_dim: "mla" only: the trailing rotary elements of the entry (0 for "mha").

    Raises:
        ValueError: an unknown kind, a count below 1, or an "mla" spec with more than one
            head or a ``rope_dim`` outside ``[1, head_dim)`` (named in the message).
    """

    kind: str
    num_kv_heads: int
    head_dim: int
    rope_dim: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KV_KINDS:
            raise ValueError(f"kind must be one of {KV_KINDS}, got {self.kind!r}")
        for name in ("num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "mha" and self.rope_dim:
            raise ValueError(f"rope_dim is for the mla kind only, got {self.rope_dim}")
        if self.kind == "mla":
            if self.num_kv_heads != 1:
                raise ValueError(f"an mla cache has one latent per token, got "
                                 f"num_kv_heads={self.num_kv_heads}")
            if not 0 < self.rope_dim < self.head_dim:
                raise ValueError(f"rope_dim must be in [1, head_dim={self.head_dim}), "
                                 f"got {self.rope_dim}")

    @classmethod
    def mha(cls, num_kv_heads: int, head_dim: int) -> KVCacheSpec:
        """Per-head K and V: ``2 x num_kv_heads x head_dim`` elements per token and layer."""
        return cls("mha", num_kv_heads, head_dim)

    @classmethod
    def mla(cls, kv_lora_rank: int, rope_dim: int) -> KVCacheSpec:
        """DeepSeek's latent: ``kv_lora_rank + rope_dim`` elements per token and layer."""
        return cls("mla", 1, kv_lora_rank + rope_dim, rope_dim)

    @property
    def num_components(self) -> int:
        """Entries per token and layer: 2 (K, V) for "mha", 1 (the latent) for "mla"."""
        return 2 if self.kind == "mha" else 1

    @property
    def elems_per_token_layer(self) -> int:
        """Cache elements of one token in one layer."""
        return self.num_components * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class KVCacheLayout:
    """What a KV block's bytes mean; two engines may share blocks only if equal.

    A block is ``kv_cache[b]`` of the engine's cache tensor
    ``[num_blocks, num_layers, C, block_size, num_kv_heads, head_dim]``: every layer's
    entries, contiguous; ``C = 2`` (K and V) for the "mha" kind, ``C = 1`` (the latent,
    ``num_kv_heads = 1``) for "mla" (see ``KVCacheSpec``).

    Attributes:
        model_id: the model's identifier (path or name).
        num_layers: transformer layers (a block holds all of them).
        num_kv_heads: KV heads per layer (of this tensor-parallel shard).
        head_dim: size of one head.
        dtype: torch dtype name of the cache without ``torch.``: "float32",
            "bfloat16", "float16", or an FP8 cache's "float8_e4m3fn" / "float8_e5m2".
        block_size: tokens per block.
        tp_rank: tensor-parallel rank whose shard the block holds.
        tp_size: tensor-parallel world size.
        kind: "mha" or "mla" (``KVCacheSpec.kind``).
        rope_dim: "mla": the rotary elements at the end of ``head_dim`` (0 for "mha").
        kv_scales: an FP8 cache's scales' identity (``kernels.kv_quant.scales_id``: a hash
            of every layer's K and V scale), "" for a cache stored unscaled: blocks
            quantized under other scales are another layout.

    Raises:
        ValueError: a field out of range (named in the message).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    kind: str = "mha"
    rope_dim: int = 0
    kv_scales: str = ""

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        # kind, heads and rope_dim are valid only together: the spec checks them
        KVCacheSpec(self.kind, self.num_kv_heads, self.head_dim, self.rope_dim)

    @classmethod
    def of_spec(cls, spec: KVCacheSpec, *, model_id: str, num_layers: int, dtype: str,
                block_size: int, tp_rank: int = 0, tp_size: int = 1,
                kv_scales: str = "") -> KVCacheLayout:
        """The layout of a cache of ``spec`` per token and layer.

        Raises:
            ValueError: as the class.
        """
        return cls(model_id=model_id, num_layers=num_layers, num_kv_heads=spec.num_kv_heads,
                   head_dim=spec.head_dim, dtype=dtype, block_size=block_size,
                   tp_rank=tp_rank, tp_size=tp_size, kind=spec.kind, rope_dim=spec.rope_dim,
                   kv_scales=kv_scales)

    @property
    def spec(self) -> KVCacheSpec:
        """What one layer caches per token (raises ValueError as ``KVCacheSpec``)."""
        return KVCacheSpec(self.kind, self.num_kv_heads, self.head_dim, self.rope_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: ``(num_layers, C, block_size, num_kv_heads, head_dim)``,
        ``C`` 2 for "mha", 1 for "mla"."""
        return (self.num_layers, self.spec.num_components, self.block_size, self.num_kv_heads,
                self.head_dim)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes of one block: ``num_layers * C * block_size * num_kv_heads * head_dim *
        itemsize`` (``C`` as in ``block_shape``)."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * DTYPE_ITEMSIZE[self.dtype]

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """``FINGERPRINT_BYTES`` bytes of SHA-256 over the canonical ``name=value|...``
        string of the fields, stable across processes and machines.

        NOTE: the tensor-parallel fields enter the string only when ``tp_size > 1``, so
        an unsharded layout keeps the fingerprint it had before those fields existed
        (blocks already in a store stay readable); likewise ``kind`` and ``rope_dim`` enter
        only for an "mla" layout, so every "mha" fingerprint is what it was, and no "mla"
        one can equal an "mha" one of any geometry (its string names ``kind=mla``);
        ``kv_scales`` enters only when set (an FP8 cache, whose dtype differs anyway).
        Computed once per object: the store client compares it with every key.
        """
        names = [f.name for f in fields(self)]
        if self.tp_size == 1:
            names = [n for n in names if n not in ("tp_rank", "tp_size")]
        if self.kind == "mha":
            names = [n for n in names if n not in ("kind", "rope_dim")]
        if not self.kv_scales:
            names.remove("kv_scales")
        canon = "|".join(f"{n}={getattr(self, n)}" for n in names)
        return hashlib.sha256(canon.encode()).digest()[:FINGERPRINT_BYTES]

    def key(self, block_hash: bytes) -> BlockKey:
        """The store key of ``block_hash`` under this layout."""
        return BlockKey(BlockHash(bytes(block_hash)), self.fingerprint)

    def keys(self, block_hashes: Sequence[bytes]) -> list[BlockKey]:
        """:meth:`key` of each hash, in order."""
        fingerprint = self.fingerprint
        return [BlockKey(BlockHash(bytes(h)), fingerprint) for h in block_hashes]
