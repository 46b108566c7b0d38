"""Content-addressed block hashes: the one hash chain shared by engine, store and router.

Block ``i``'s hash covers block ``i-1``'s hash, block ``i``'s token ids and
optional extra keys, so equal hashes mean equal prefixes (vLLM's prefix-cache
hash chain). SHA-256 is used because the hashes are compared across processes
and machines: Python's seeded ``hash`` would differ between processes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

#: Name of the algorithm; prefill and decode compare it at handshake.
HASH_ALGORITHM = "sha256-chain-v1"

#: Length of one block hash in bytes (a SHA-256 digest).
BLOCK_HASH_BYTES = 32

#: Parent hash of block 0. Any fixed value works; it must never change.
ROOT_HASH = BlockHash(hashlib.sha256(b"tandem-root-v1").digest())


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash one block of token ids chained on its parent's hash.

    Args:
        parent: hash of the previous block, ``None`` for the first block.
        token_ids: the block's token ids (``block_size`` of them for a full block).
        extra_keys: anything else that changes the KV (e.g. a LoRA id); must have
            a stable ``repr``.

    Returns:
        ``BLOCK_HASH_BYTES``-byte ``BlockHash``.
    """
    h = hashlib.sha256()
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest())


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] | None = None,
    *,
    include_partial: bool = False,
) -> list[BlockHash]:
    """Hash chain of every full block of ``token_ids`` (and the partial tail if asked).

    Args:
        token_ids: a token sequence.
        block_size: tokens per block.
        include_partial: also hash the trailing partial block (used by the KV
            store to publish a prompt's last, partial block; the engine's prefix
            cache never holds partial blocks).

    Returns:
        ``len(token_ids) // block_size`` hashes (one more with a partial tail
        when ``include_partial``).
    """
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    n_full = len(token_ids) // block_size
    for i in range(n_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    if include_partial and len(token_ids) % block_size:
        hashes.append(hash_block(parent, token_ids[n_full * block_size :], extra_keys))
    return hashes


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The store hashes of a prompt's KV blocks: every full block, then the partial tail.

    What a prefill publishes and a decode loads (``PrefillResponse.block_hashes``):
    ``ceil(len(prompt_token_ids) / block_size)`` hashes, no extra keys.
    """
    return hash_token_blocks(prompt_token_ids, block_size, include_partial=True)
