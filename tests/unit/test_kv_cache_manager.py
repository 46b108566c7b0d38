"""KV cache manager: exact block tables, ref counts, eviction order, prefix hits, hashes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from tandem.contracts.block_hash import hash_block
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams

BS = 16


def make_manager(num_blocks: int = 10, block_size: int = BS, caching: bool = True):
    return KVCacheManager(num_blocks, block_size, enable_caching=caching)


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=8))


def admit(kvm: KVCacheManager, req: Request) -> list[int]:
    """Admit like the scheduler does: prefix lookup, allocate the rest, mark computed."""
    hits, num_hit = kvm.get_computed_blocks(req)
    new = kvm.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    kvm.record_prefix_cache_lookup(req, num_hit)
    req.num_computed_tokens = req.num_tokens  # the forward ran
    return kvm.get_block_ids(req.request_id)


def free_ids(kvm: KVCacheManager) -> list[int]:
    return [b.block_id for b in kvm.block_pool.free_block_queue.get_all_free_blocks()]


def ref_cnts(kvm: KVCacheManager, ids: list[int]) -> list[int]:
    return [kvm.block_pool.blocks[i].ref_cnt for i in ids]


def test_allocation_builds_block_table_and_caches_full_blocks_only() -> None:
    kvm = make_manager()
    req = make_request("a", list(range(40)))
    assert admit(kvm, req) == [0, 1, 2]
    assert kvm.num_free_blocks == 7
    hashes = kvm.get_block_hashes(req)
    assert len(hashes) == 2  # 40 tokens: two full blocks, partial tail not hashed
    assert kvm.block_pool.get_cached_block(hashes[0]).block_id == 0
    assert kvm.block_pool.get_cached_block(hashes[1]).block_id == 1
    assert kvm.block_pool.blocks[2].block_hash is None


def test_prefix_hit_shares_blocks_with_ref_counts() -> None:
    kvm = make_manager()
    a = make_request("a", list(range(40)))
    admit(kvm, a)
    b = make_request("b", list(range(32)) + [900, 901, 902])
    hits, num_hit = kvm.get_computed_blocks(b)
    assert hits.get_block_ids() == [0, 1] and num_hit == 32
    assert ref_cnts(kvm, [0, 1]) == [1, 1]  # a lookup takes no reference
    kvm.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits)
    kvm.record_prefix_cache_lookup(b, num_hit)
    assert kvm.get_block_ids("b") == [0, 1, 3]
    assert ref_cnts(kvm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    stats = kvm.prefix_cache_stats
    assert (stats.num_requests, stats.queries, stats.hits) == (2, 40 + 35, 32)


def test_whole_prompt_hit_leaves_the_last_token_to_compute() -> None:
    kvm = make_manager()
    admit(kvm, make_request("a", list(range(32))))
    twin = make_request("twin", list(range(32)))
    hits, num_hit = kvm.get_computed_blocks(twin)
    # Two full blocks are cached, but only one may be reused: a sample needs a token.
    assert hits.get_block_ids() == [0] and num_hit == 16


def test_n_siblings_share_the_prompt_blocks_and_pool_returns_to_full() -> None:
    kvm = make_manager()
    prompt = list(range(50))
    sibs = [make_request(f"s{i}", prompt) for i in range(3)]
    tables = [admit(kvm, r) for r in sibs]
    assert tables == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 5]]
    assert ref_cnts(kvm, [0, 1, 2, 3, 4, 5]) == [3, 3, 3, 1, 1, 1]
    for r in sibs:
        r.status = RequestStatus.FINISHED_STOPPED
        kvm.free(r)
    assert kvm.num_free_blocks == 10
    assert ref_cnts(kvm, list(range(10))) == [0] * 10


def test_free_order_evicts_a_sequences_tail_before_its_head() -> None:
    kvm = make_manager(num_blocks=6)
    a = make_request("a", list(range(48)))  # 3 full blocks
    admit(kvm, a)
    a.status = RequestStatus.FINISHED_STOPPED
    kvm.free(a)
    assert free_ids(kvm) == [3, 4, 5, 2, 1, 0]
    # A new 4-block request evicts the never-used blocks, then a's tail block.
    b = make_request("b", list(range(1000, 1064)))
    assert admit(kvm, b) == [3, 4, 5, 2]
    h = kvm.get_block_hashes(a) if "a" in kvm.req_to_block_hashes else None
    assert h is None  # a finished request's hashes are dropped
    c = make_request("c", list(range(48)) + [7])
    hits, num_hit = kvm.get_computed_blocks(c)
    assert hits.get_block_ids() == [0, 1] and num_hit == 32  # block 2 was evicted


def test_allocation_failure_changes_nothing() -> None:
    kvm = make_manager(num_blocks=4)
    admit(kvm, make_request("a", list(range(40))))  # 3 blocks
    big = make_request("big", list(range(500, 540)))
    before = free_ids(kvm)
    assert kvm.allocate_slots(big, 40) is None
    assert free_ids(kvm) == before and not kvm.has_blocks("big")


def test_free_prefix_hits_count_against_free_blocks() -> None:
    """Touching a free cached block removes it from the free queue, so it cannot also
    be counted as allocatable."""
    kvm = make_manager(num_blocks=3)
    a = make_request("a", list(range(32)))
    admit(kvm, a)
    a.status = RequestStatus.FINISHED_STOPPED
    kvm.free(a)
    assert kvm.num_free_blocks == 3
    b = make_request("b", list(range(32)) + list(range(100, 133)))  # 65 tokens: 5 blocks
    hits, num_hit = kvm.get_computed_blocks(b)
    assert num_hit == 32
    # Needs 3 new blocks; 3 are free but 2 of them are the hits themselves.
    assert kvm.allocate_slots(b, b.num_tokens - num_hit, num_hit, hits) is None
    assert kvm.num_free_blocks == 3 and all(x.ref_cnt == 0 for x in kvm.block_pool.blocks)


def test_decode_growth_allocates_a_block_per_block_size_tokens_and_caches_it() -> None:
    kvm = make_manager()
    req = make_request("a", list(range(15)))
    assert admit(kvm, req) == [0]
    for step in range(20):
        req.append_output_token(100 + step)
        new = kvm.allocate_slots(req, 1)
        assert new is not None
        assert len(new) == (1 if req.num_computed_tokens % BS == 0 else 0)
        req.num_computed_tokens += 1
    assert kvm.get_block_ids("a") == [0, 1, 2]
    hashes = kvm.get_block_hashes(req)
    assert len(hashes) == 2
    # The second block's hash covers generated tokens.
    assert hashes[1] == hash_block(hashes[0], req.all_token_ids[16:32])
    assert kvm.block_pool.get_cached_block(hashes[1]).block_id == 1


def test_free_uncaches_blocks_whose_kv_was_never_computed() -> None:
    kvm = make_manager()
    req = make_request("a", list(range(40)))
    kvm.allocate_slots(req, 40)  # registered at allocation ...
    hashes = kvm.get_block_hashes(req)
    assert kvm.block_pool.get_cached_block(hashes[1]) is not None
    req.num_computed_tokens = 16  # ... but preempted after only one block was computed
    kvm.free(req)
    assert kvm.block_pool.get_cached_block(hashes[0]).block_id == 0
    assert kvm.block_pool.get_cached_block(hashes[1]) is None
    assert "a" in kvm.req_to_block_hashes  # not finished: hashes kept for the resume


def test_delay_cache_blocks_then_cache_blocks() -> None:
    kvm = make_manager()
    req = make_request("a", list(range(40)))
    kvm.allocate_slots(req, 39, delay_cache_blocks=True)
    assert kvm.block_pool.num_cached_blocks == 0
    req.num_computed_tokens = 20  # a load that fell short
    kvm.cache_blocks(req, req.num_computed_tokens)
    assert kvm.block_pool.num_cached_blocks == 1


def test_caching_disabled_never_hits() -> None:
    kvm = make_manager(caching=False)
    admit(kvm, make_request("a", list(range(40))))
    hits, num_hit = kvm.get_computed_blocks(make_request("b", list(range(40))))
    assert len(hits) == 0 and num_hit == 0
    assert kvm.block_pool.num_cached_blocks == 0
    assert kvm.prefix_cache_stats.queries == 0


def test_block_hashes_are_a_sha256_chain_stable_across_processes() -> None:
    """The hashes are compared across services: they must not depend on the process
    (Python's seeded ``hash`` would), and must follow the documented chain."""
    kvm = make_manager()
    tokens = list(range(7, 7 + 40))
    req = make_request("a", tokens)
    ours = [h.hex() for h in kvm.get_block_hashes(req)]
    # An independent computation of the spec with hashlib only, in another process
    # with a different hash seed.
    code = (
        "import hashlib, struct\n"
        f"toks = {tokens!r}\n"
        "parent = hashlib.sha256(b'tandem-root-v1').digest()\n"
        "for i in range(len(toks) // 16):\n"
        "    parent = hashlib.sha256(parent + struct.pack('<16q', *toks[i*16:(i+1)*16])).digest()\n"
        "    print(parent.hex())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    proc = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert proc.stdout.split() == ours
    # And pinned: a change of the spec must be deliberate (HASH_ALGORITHM bump).
    root = hashlib.sha256(b"tandem-root-v1").digest()
    first = hashlib.sha256(root + struct.pack("<16q", *range(16))).hexdigest()
    assert hash_block(None, list(range(16))).hex() == first


def test_negative_num_new_tokens_is_rejected() -> None:
    kvm = make_manager()
    with pytest.raises(ValueError, match="num_new_tokens"):
        kvm.allocate_slots(make_request("a", [1]), -1)
