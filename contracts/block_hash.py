"""Content-addressed block hashes: the one hash chain shared by engine, store and router.

Block ``i``'s hash covers block ``i-1``'s hash, block ``i``'s token ids and
optional extra keys, so equal hashes mean equal prefixes (vLLM's prefix-cache
hash chain). A request's ``cache_salt`` (vLLM's request field) is mixed into block
0's hash only; every later block inherits it through the chain, so requests with
different salts share no block, locally or in the KV store, and an empty or absent
salt gives the unsalted chain. SHA-256 is used because the hashes are compared across processes
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


#: Separates the salt from the token bytes, so no token sequence hashes like a salt.
_SALT_TAG = b"tandem-cache-salt-v1\x00"


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
    *,
    cache_salt: str | None = None,
) -> BlockHash:
    """Hash one block of token ids chained on its parent's hash.

    Args:
        parent: hash of the previous block, ``None`` for the first block.
        token_ids: the block's token ids (``block_size`` of them for a full block).
        extra_keys: anything else that changes the KV (e.g. a LoRA id); must have
            a stable ``repr``.
        cache_salt: the request's salt, first block only (``parent`` is ``None``);
            ``None`` or ``""``: unsalted, the same hash as without it.

    Returns:
        ``BLOCK_HASH_BYTES``-byte ``BlockHash``.

    Raises:
        ValueError: naming ``cache_salt`` when one is given for a block with a parent.
    """
    if cache_salt and parent is not None:
        raise ValueError("cache_salt applies to the first block only (parent must be None)")
    h = hashlib.sha256()
    h.update(parent if parent is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    if cache_salt:
        salt = cache_salt.encode()
        h.update(_SALT_TAG + struct.pack("<q", len(salt)) + salt)
    return BlockHash(h.digest())


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] | None = None,
    *,
    include_partial: bool = False,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hash chain of every full block of ``token_ids`` (and the partial tail if asked).

    Args:
        token_ids: a token sequence.
        block_size: tokens per block.
        include_partial: also hash the trailing partial block (used by the KV
            store to publish a prompt's last, partial block; the engine's prefix
            cache never holds partial blocks).
        cache_salt: the request's salt, mixed into the first block's hash (and so
            into every hash of the chain); ``None`` or ``""``: unsalted.

    Returns:
        ``len(token_ids) // block_size`` hashes (one more with a partial tail
        when ``include_partial``).
    """
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    n_full = len(token_ids) // block_size
    for i in range(n_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys,
                            cache_salt=cache_salt if i == 0 else None)
        hashes.append(parent)
    if include_partial and len(token_ids) % block_size:
        hashes.append(hash_block(parent, token_ids[n_full * block_size :], extra_keys,
                                 cache_salt=cache_salt if n_full == 0 else None))
    return hashes


def prompt_block_hashes(
    prompt_token_ids: Sequence[int], block_size: int, *, cache_salt: str | None = None
) -> list[BlockHash]:
    """The store hashes of a prompt's KV blocks: every full block, then the partial tail.

    What a prefill publishes and a decode loads (``PrefillResponse.block_hashes``):
    ``ceil(len(prompt_token_ids) / block_size)`` hashes, no extra keys, salted with the
    request's ``cache_salt`` (``None`` or ``""``: unsalted).
    """
    return hash_token_blocks(prompt_token_ids, block_size, include_partial=True,
                             cache_salt=cache_salt)
