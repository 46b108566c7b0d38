"""The KV contracts: layout and fingerprint, block keys, the decode side's handoff."""

from __future__ import annotations

import pytest

from tandem.contracts.block_hash import (
    BLOCK_HASH_BYTES,
    BlockHash,
    hash_token_blocks,
    prompt_block_hashes,
)
from tandem.contracts.block_key import BlockKey, KVTransferParams
from tandem.contracts.kv_layout import KVCacheLayout


def test_fingerprint_is_stable_and_separates_layouts() -> None:
    layout = KVCacheLayout("smollm2", 30, 3, 64, "bfloat16", 16)
    # Pinned: blocks already in a store must stay readable after an upgrade, and the
    # engine and the store once had one class each, kept equal by hand.
    assert layout.fingerprint.hex() == "b6cdec120af2331433b1b745944ad753"
    assert layout.block_bytes == 30 * 2 * 16 * 3 * 64 * 2
    assert layout.block_shape == (30, 2, 16, 3, 64)
    others = [
        KVCacheLayout("smollm2", 30, 3, 64, "float32", 16),
        KVCacheLayout("smollm2", 30, 3, 64, "bfloat16", 32),
        KVCacheLayout("other", 30, 3, 64, "bfloat16", 16),
        KVCacheLayout("smollm2", 30, 3, 64, "bfloat16", 16, tp_rank=1, tp_size=2),
    ]
    assert others[3].fingerprint.hex() == "f465203b0e55da5c73bd1d3f1bc1206a"
    assert len({layout.fingerprint, *(o.fingerprint for o in others)}) == 5
    h = bytes(32)
    assert layout.key(h) != others[0].key(h)
    assert layout.keys([h, h]) == [BlockKey(h, layout.fingerprint)] * 2


def test_layout_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVCacheLayout("m", 1, 1, 1, "int8", 16)
    with pytest.raises(ValueError, match="tp_rank"):
        KVCacheLayout("m", 1, 1, 1, "float32", 16, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="num_layers"):
        KVCacheLayout("m", 0, 1, 1, "float32", 16)
    with pytest.raises(ValueError, match="model_id"):
        KVCacheLayout("", 1, 1, 1, "float32", 16)


def test_block_key_string_and_bytes_forms() -> None:
    k = BlockKey(bytes(range(32)), bytes(16))
    assert BlockKey.from_str(str(k)) == k
    assert BlockKey.from_bytes(k.to_bytes()) == k
    assert k.redis_key == "tandem:kv:blk:" + str(k)
    with pytest.raises(ValueError, match="hash"):
        BlockKey(b"", b"fp")
    with pytest.raises(ValueError, match="malformed"):
        BlockKey.from_bytes(b"\x05ab")
    with pytest.raises(ValueError, match="not hex"):
        BlockKey.from_str("zz:yy")


def test_prompt_block_hashes_cover_the_partial_tail() -> None:
    prompt = list(range(40))
    hashes = prompt_block_hashes(prompt, 16)
    assert len(hashes) == 3 and all(len(h) == BLOCK_HASH_BYTES for h in hashes)
    assert hashes[:2] == hash_token_blocks(prompt, 16)
    assert prompt_block_hashes(prompt[:32], 16) == hashes[:2]


def test_kv_transfer_params_check_hash_lengths_and_make_keys() -> None:
    hashes = tuple(prompt_block_hashes(list(range(20)), 16))
    params = KVTransferParams(hashes, b"fp")
    assert params.keys() == [BlockKey(h, b"fp") for h in hashes]
    with pytest.raises(ValueError, match=r"block_hashes\[1\] has 3 bytes"):
        KVTransferParams((hashes[0], BlockHash(b"abc")), b"fp")
    with pytest.raises(ValueError, match="layout_fingerprint"):
        KVTransferParams(hashes, b"")
