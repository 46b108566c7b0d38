"""KV store end to end: real redis-server, real store nodes in subprocesses, UCX on loopback.

Gets from a node on this host read its shared-memory pool (kvstore/shm.py) unless the
client has ``ClientOptions(shm=False)``: the get tests that matter run both ways
(``read_path``). Faults are injected through the test's own access to a node's pool
segment (``corrupt_block``), never through the store's protocol.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import redis
import torch
from kvstore_harness import StoreNodeProcess, corrupt_block, poll

from tandem.contracts.block_key import BlockKey
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.kvstore.client import ClientOptions, KVStoreClient, wait_for_nodes
from tandem.kvstore.shm_ctl import CtlChannel, ctl_address
from tandem.kvstore.store import KVStoreError, KVStoreNodeError, KVStoreTimeoutError

pytest.importorskip("ucxx")

# Equal block bytes (32 KiB, above UCX's rendezvous threshold) for both dtypes so
# that both layouts share a node's slots.
BF16 = KVCacheLayout("tiny-test", num_layers=4, num_kv_heads=2, head_dim=64,
                     dtype="bfloat16", block_size=16)
FP32 = KVCacheLayout("tiny-test", num_layers=4, num_kv_heads=2, head_dim=32,
                     dtype="float32", block_size=16)
BLOCK = BF16.block_bytes
assert FP32.block_bytes == BLOCK


def shape(layout: KVCacheLayout) -> tuple[int, ...]:
    return layout.block_shape


def random_blocks(layout: KVCacheLayout, n: int, seed: int) -> list[torch.Tensor]:
    """Blocks of random bit patterns (NaNs, infs, denormals included)."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    bits = torch.int16 if dtype.itemsize == 2 else torch.int32
    info = torch.iinfo(bits)
    return [torch.randint(info.min, info.max, shape(layout), generator=g, dtype=bits)
            .view(dtype) for _ in range(n)]


def hashes(tag: str, n: int) -> list[bytes]:
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bytes(a.contiguous().view(torch.uint8).numpy()) == \
        bytes(b.contiguous().view(torch.uint8).numpy())


@pytest.fixture(scope="module")
def store_url(redis_url: str) -> str:
    # NOTE: a database of its own: other modules' nodes and keys stay invisible.
    return redis_url.rsplit("/", 1)[0] + "/3"


@pytest.fixture(scope="module")
def nodes(store_url: str, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("kvstore")
    procs = {
        "n1": StoreNodeProcess(store_url, "n1", 4 << 20, log_dir=logs),
        "n2": StoreNodeProcess(store_url, "n2", 4 << 20, log_dir=logs),
    }
    client = KVStoreClient(store_url, timeout_s=10)
    try:
        for p in procs.values():
            p.wait_ready(client)
        yield procs
    finally:
        client.close()
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def client(store_url: str, nodes) -> KVStoreClient:
    c = KVStoreClient(store_url, local_node=nodes["n1"].address, timeout_s=10)
    yield c
    c.close()


@pytest.fixture(params=["shm", "ucx"])
def read_path(request: pytest.FixtureRequest) -> str:
    """How gets read a node on this host: its shared-memory pool, or UCX."""
    return request.param


def used_path(c: KVStoreClient, shm_gets_before: int) -> str:
    return "shm" if c.num_shm_reads > shm_gets_before else "ucx"


@pytest.fixture(scope="module")
def ucx_client(store_url: str, nodes) -> KVStoreClient:
    c = KVStoreClient(store_url, local_node=nodes["n1"].address, timeout_s=10,
                      options=ClientOptions(shm=False))
    yield c
    c.close()


def test_round_trip_bf16_and_fp32_is_bit_exact(store_url: str, nodes, read_path: str) -> None:
    for layout, seed in ((BF16, 1), (FP32, 2)):
        c = KVStoreClient(store_url, layout=layout, local_node="n1", timeout_s=10,
                          options=ClientOptions(shm=read_path == "shm"))
        keys = layout.keys(hashes(f"rt-{layout.dtype}-{read_path}", 6))
        blocks = random_blocks(layout, 6, seed)
        assert c.put_blocks(keys, blocks) == 6
        assert c.lookup(keys) == 6
        into = [torch.empty_like(b) for b in blocks]
        assert c.get_blocks(keys, into) == 6
        assert used_path(c, 0) == read_path
        assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
        c.close()


def test_batched_get_across_nodes_and_lookup_agrees(store_url: str, nodes,
                                                    read_path: str) -> None:
    keys = BF16.keys(hashes(f"multi-{read_path}", 10))
    blocks = random_blocks(BF16, 10, 3)
    shm = read_path == "shm"
    c1 = KVStoreClient(store_url, local_node=nodes["n1"].address, options=ClientOptions(shm=shm))
    c2 = KVStoreClient(store_url, local_node=nodes["n2"].address, options=ClientOptions(shm=shm))
    assert c1.put_blocks(keys[:5], blocks[:5]) == 5
    assert c2.put_blocks(keys[5:], blocks[5:]) == 5
    assert set(c1.stat("n1")["lru"]) >= {k.redis_key for k in keys[:5]}
    assert set(c1.stat("n2")["lru"]) >= {k.redis_key for k in keys[5:]}
    into = [torch.empty_like(b) for b in blocks]
    assert c1.lookup(keys) == 10
    assert c1.get_blocks(keys, into) == 10  # one call, two nodes
    assert c1.num_shm_reads == (2 if shm else 0)
    assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    # a gap ends the leading run for lookup and get alike
    gap = keys[:3] + BF16.keys(hashes("never-stored", 1)) + keys[4:]
    assert c1.lookup(gap) == 3
    assert c1.get_blocks(gap, [torch.empty_like(b) for b in blocks]) == 3
    assert c1.contains(gap) == [True] * 3 + [False] + [True] * 6
    c1.close()
    c2.close()


@pytest.mark.timeout(60)
def test_one_get_over_two_nodes_and_a_killed_one(store_url: str, nodes, tmp_path,
                                                 read_path: str) -> None:
    """Blocks put on two nodes (each client's ``local_node``), interleaved, and a last
    one on a third node that is then killed: ONE get returns every block of the two
    live nodes intact and a miss for exactly the dead node's (the last key, so the run
    of leading blocks before it is whole). The client's timeout (600 s) is beyond the
    test's: waiting for the dead node fails the test."""
    shm = ClientOptions(shm=read_path == "shm")
    doomed = StoreNodeProcess(store_url, f"doomed-multi-{read_path}", 1 << 20,
                              log_dir=tmp_path)
    c1 = KVStoreClient(store_url, local_node=nodes["n1"].address, timeout_s=600, options=shm)
    c2 = KVStoreClient(store_url, local_node=nodes["n2"].address, timeout_s=600, options=shm)
    c3 = KVStoreClient(store_url, local_node=doomed.node_id, timeout_s=600, options=shm)
    try:
        doomed.wait_ready(c3)
        keys = BF16.keys(hashes(f"spread-{read_path}", 9))
        blocks = random_blocks(BF16, 9, 21)
        assert c1.put_blocks(keys[0:8:2], blocks[0:8:2]) == 4
        assert c2.put_blocks(keys[1:8:2], blocks[1:8:2]) == 4
        assert c3.put_blocks(keys[8:], blocks[8:]) == 1
        assert set(c1.stat("n1")["lru"]) >= {k.redis_key for k in keys[0:8:2]}
        assert set(c1.stat("n2")["lru"]) >= {k.redis_key for k in keys[1:8:2]}
        assert c1.stat(doomed.node_id)["lru"] == [keys[8].redis_key]
        into = [torch.zeros_like(b) for b in blocks]
        assert c1.get_blocks(keys, into) == 9  # one call, three nodes
        assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
        doomed.kill()
        assert doomed.node_id in c1.live_nodes(), "its heartbeat has not expired yet"
        into = [torch.zeros_like(b) for b in blocks]
        assert c1.get_blocks(keys, into) == 8, "a miss for exactly the dead node's block"
        assert all(same_bits(a, b) for a, b in zip(blocks[:8], into[:8], strict=True))
        assert c1.contains(keys) == [True] * 8 + [False]
    finally:
        for c in (c1, c2, c3):
            c.close()
        doomed.stop()


@pytest.mark.parametrize(("shm", "copy_threads"), [(True, 1), (True, 3), (False, 1)])
def test_blocks_of_one_cache_tensor_move_in_runs(store_url: str, nodes, shm: bool,
                                                 copy_threads: int, monkeypatch) -> None:
    """Consecutive cache blocks travel as one message; scattered ones block by block
    (shared memory: also when the copy is split between threads)."""
    from tandem.kvstore import shm_read

    monkeypatch.setattr(shm_read, "PARALLEL_COPY_MIN_BYTES", 0)  # 256 KiB here
    client = KVStoreClient(store_url, local_node="n1",
                           options=ClientOptions(shm=shm, copy_threads=copy_threads))
    src = torch.cat([b.unsqueeze(0) for b in random_blocks(BF16, 8, 12)])  # a kv_cache
    keys = BF16.keys(hashes(f"runs-{shm}-{copy_threads}", 8))
    assert client.put_blocks(keys, [src[b] for b in range(8)]) == 8
    dst = torch.zeros_like(src)
    # block ids 1,2,3 adjacent, then 7, then 4,5 adjacent again, 0, 6
    ids = [1, 2, 3, 7, 4, 5, 0, 6]
    assert client.get_blocks(keys, [dst[b] for b in ids]) == 8
    for i, b in enumerate(ids):
        assert same_bits(dst[b], src[i])
    client.close()


def test_stale_expected_cut_falls_back_to_two_step_get(ucx_client: KVStoreClient) -> None:
    """A get that expects slots the index no longer describes gets nothing wrong (UCX)."""
    client = ucx_client
    from dataclasses import replace

    keys = BF16.keys(hashes("stale", 3))
    blocks = random_blocks(BF16, 3, 14)
    assert client.put_blocks(keys, blocks) == 3
    aio = client.aio

    async def get_with_stale_index() -> tuple[set[int], list[torch.Tensor]]:
        entries, nodes = await aio.index(keys)
        node = replace(nodes[entries[0].node_id], slot_bytes=BLOCK)
        # slots that moved: adjacent where the real ones are not, and vice versa, so
        # the cut into messages the client expects differs from the node's
        real = [e.slot for e in entries]
        adjacent = real == list(range(real[0], real[0] + 3))
        moved = [real[0] + 10 * i for i in range(3)] if adjacent else [0, 1, 2]
        wrong = [replace(e, slot=m) for e, m in zip(entries, moved, strict=True)]
        cache = torch.zeros((3, *blocks[0].shape), dtype=blocks[0].dtype)
        dst = list(cache)  # adjacent rows: one run on the client side
        views = [d.view(torch.uint8).reshape(-1).numpy() for d in dst]
        got = await aio.ucx.read(node, [k.redis_key for k in keys], views, wrong)
        return got, dst

    # once the registry shows the node's slot size, gets post receives up front
    poll(lambda: client.live_nodes()["n1"].slot_bytes == BLOCK)
    fast, stale = aio.ucx.num_fast_gets, aio.ucx.num_stale_gets
    into = [torch.empty_like(b) for b in blocks]
    assert client.get_blocks(keys, into) == 3
    assert aio.ucx.num_fast_gets == fast + 1
    assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))

    got, dst = client.run(get_with_stale_index())
    assert aio.ucx.num_stale_gets == stale + 1
    assert set(got) == {0, 1, 2}
    assert all(same_bits(a, b) for a, b in zip(blocks, dst, strict=True))


def test_put_of_present_keys_sends_nothing_and_keeps_data(client: KVStoreClient) -> None:
    keys = BF16.keys(hashes("dedupe", 3))
    blocks = random_blocks(BF16, 3, 4)
    assert client.put_blocks(keys, blocks) == 3
    assert client.put_blocks(keys, blocks) == 3
    into = [torch.empty_like(b) for b in blocks]
    assert client.get_blocks(keys, into) == 3
    assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))


def test_eight_writers_and_eight_readers(store_url: str, nodes, read_path: str) -> None:
    shared = KVStoreClient(store_url, local_node="n2", timeout_s=20,
                           options=ClientOptions(shm=read_path == "shm"))
    seed_keys = BF16.keys(hashes(f"readers-{read_path}", 4))
    seed_blocks = random_blocks(BF16, 4, 5)
    assert shared.put_blocks(seed_keys, seed_blocks) == 4
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            keys = BF16.keys(hashes(f"writer{w}-{read_path}", 3))
            blocks = random_blocks(BF16, 3, 100 + w)
            assert shared.put_blocks(keys, blocks) == 3
            into = [torch.empty_like(b) for b in blocks]
            assert shared.get_blocks(keys, into) == 3
            assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def reader(r: int) -> None:
        try:
            for _ in range(3):
                into = [torch.empty_like(b) for b in seed_blocks]
                assert shared.get_blocks(seed_keys, into) == 4
                assert all(same_bits(a, b) for a, b in zip(seed_blocks, into, strict=True))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert used_path(shared, 0) == read_path
    shared.close()
    assert not errors, errors


def test_concurrent_puts_of_one_prefix_do_not_fail(store_url: str, nodes) -> None:
    """Two prefills finishing the same prompt at once publish the same blocks."""
    keys = BF16.keys(hashes("same-prefix", 6))
    blocks = random_blocks(BF16, 6, 13)
    c = KVStoreClient(store_url, local_node="n1")
    errors: list[BaseException] = []

    def put() -> None:
        try:
            c.put_blocks(keys, blocks)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    into = [torch.empty_like(b) for b in blocks]
    assert c.get_blocks(keys, into) == 6
    assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    c.close()


def test_bad_inputs_are_clear_errors_and_the_node_keeps_serving(
        store_url: str, client: KVStoreClient) -> None:
    keys = BF16.keys(hashes("bad", 2))
    blocks = random_blocks(BF16, 2, 6)
    typed = KVStoreClient(store_url, layout=BF16, local_node="n1")
    # wrong block size: checked by a client that knows the layout ...
    with pytest.raises(ValueError, match=r"blocks\[0\].*wrong block size"):
        typed.put_blocks(keys[:1], [torch.zeros(BLOCK // 2, dtype=torch.uint8)])
    # ... and by the node, for a client that does not
    with pytest.raises(KVStoreNodeError, match="wrong block size|does not fit"):
        client.put_blocks(keys[:1], [torch.zeros(BLOCK * 2, dtype=torch.uint8)])
    # a key of another layout
    other = FP32.keys(hashes("bad", 1))
    with pytest.raises(ValueError, match=r"keys\[0\].*layout fingerprint"):
        typed.lookup(other)
    with pytest.raises(ValueError, match=r"keys\[0\] must be a BlockKey"):
        client.lookup([b"not a key"])  # type: ignore[list-item]
    # unknown key: a miss, not an error
    assert client.lookup(BF16.keys(hashes("unknown", 2))) == 0
    assert client.get_blocks(BF16.keys(hashes("unknown", 1)), [torch.empty_like(blocks[0])]) == 0
    # larger than any node's capacity
    many = BF16.keys(hashes("huge", 200))
    with pytest.raises(ValueError, match="larger than every node's capacity"):
        client.put_blocks(many, [blocks[0]] * 200)
    # read-only destination, mismatched lengths
    with pytest.raises(ValueError, match="read-only"):
        client.get_blocks(keys[:1], [bytes(BLOCK)])
    with pytest.raises(ValueError, match="2 buffers for 1 keys"):
        client.put_blocks(keys[:1], blocks)
    # the node still serves
    assert client.put_blocks(keys, blocks) == 2
    into = [torch.empty_like(b) for b in blocks]
    assert client.get_blocks(keys, into) == 2
    assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    typed.close()


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_corrupted_slot_is_a_miss(store_url: str, nodes, read_path: str, copy_threads: int,
                                  monkeypatch) -> None:
    from tandem.kvstore import shm_read

    # three threads: blocks 0-1, 2 and 3 are copied and checked by different threads
    monkeypatch.setattr(shm_read, "PARALLEL_COPY_MIN_BYTES", 0)
    client = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=read_path == "shm",
                           copy_threads=copy_threads))
    keys = BF16.keys(hashes(f"corrupt-{read_path}-{copy_threads}", 4))
    blocks = random_blocks(BF16, 4, 7)
    assert client.put_blocks(keys, blocks) == 4
    corrupt_block(client, store_url, keys[2])
    into = [torch.empty_like(b) for b in blocks]
    assert client.get_blocks(keys, into) == 2
    assert used_path(client, 0) == read_path
    assert all(same_bits(a, b) for a, b in zip(blocks[:2], into[:2], strict=True))
    assert client.aio.num_checksum_failures == 1
    assert client.lookup(keys) == 2  # the bad entry was removed from the index
    client.close()


def test_health_and_metrics(nodes, client: KVStoreClient) -> None:
    assert nodes["n1"].health() == 200
    text = nodes["n1"].metrics_text()
    for name in ("tandem:kvstore_hits_total", "tandem:kvstore_blocks_stored",
                 "tandem:kvstore_get_latency_seconds_bucket", "tandem:kvstore_put_bytes_total"):
        assert name in text


# -- nodes of their own: eviction, TTL, failures ------------------------------------------------


def test_lru_eviction_order_and_in_flight_read_guard(store_url: str, tmp_path) -> None:
    node = StoreNodeProcess(store_url, "small", 4 * BLOCK, transfer_timeout_s=8,
                            log_dir=tmp_path)
    c = KVStoreClient(store_url, local_node="small")
    try:
        node.wait_ready(c)
        k = BF16.keys(hashes("lru", 10))
        blocks = random_blocks(BF16, 10, 8)

        def lru() -> list[str]:
            return c.stat("small")["lru"]

        assert c.put_blocks(k[:4], blocks[:4]) == 4
        assert c.get_blocks(k[:1], [torch.empty_like(blocks[0])]) == 1  # k0 becomes MRU
        assert c.put_blocks(k[4:5], blocks[4:5]) == 1  # evicts k1, the LRU block
        assert lru() == [x.redis_key for x in (k[2], k[3], k[0], k[4])]
        assert c.contains(k[:5]) == [True, False, True, True, True]
        assert c.stat("small")["num_evictions"] == 1

        # A real in-flight read: ask for k2 but never post the receive, so the
        # node's send of k2 stays in flight until its transfer timeout.
        aio = c.aio

        async def start_read() -> None:
            nodes = await aio.live_nodes()
            conn = await aio.conns.get(nodes["small"])
            await conn.request(999_999, {"op": "get", "keys": [k[2].redis_key]})

        c.run(start_read())
        poll(lambda: c.stat("small")["pinned"] == [k[2].redis_key])
        # the read made k2 most recent; three puts make it the LRU block again
        for i in (5, 6, 7):
            assert c.put_blocks(k[i:i + 1], blocks[i:i + 1]) == 1
        assert lru()[0] == k[2].redis_key
        assert c.put_blocks(k[8:9], blocks[8:9]) == 1  # k2 is pinned: k5 goes instead
        assert c.contains([k[2], k[5]]) == [True, False]

        # once the stuck read is dropped, k2 is unpinned and evictable again
        def unpinned() -> bool:
            try:
                return c.stat("small")["pinned"] == []
            except KVStoreError:  # our connection was the one the node dropped
                return False

        poll(unpinned, timeout_s=30)
        assert c.put_blocks(k[9:10], blocks[9:10]) == 1
        assert c.contains([k[2]]) == [False]
    finally:
        c.close()
        node.stop()


def test_shm_read_pins_until_release_and_the_lease_expires(store_url: str, tmp_path) -> None:
    """A shared-memory read pins its blocks like a UCX get (not evicted while the client
    copies); a client that never releases (crashed) loses its pins at the lease's end."""
    node = StoreNodeProcess(store_url, "leases", 4 * BLOCK, log_dir=tmp_path,
                            extra_args=("--shm-lease-s", "3"))
    c = KVStoreClient(store_url, local_node="leases")
    try:
        node.wait_ready(c)
        k = BF16.keys(hashes("lease", 8))
        blocks = random_blocks(BF16, 8, 16)
        assert c.put_blocks(k[:4], blocks[:4]) == 4
        # a whole get releases its pins when done
        into = [torch.empty_like(b) for b in blocks[:2]]
        assert c.get_blocks(k[:2], into) == 2 and c.num_shm_reads == 1
        poll(lambda: c.stat("leases")["pinned"] == [])

        # a client that pins k2 on the node's control socket and never releases it
        info = c.live_nodes()["leases"]
        address = ctl_address(info.node_id, info.shm_id)
        holder = CtlChannel(address, timeout_s=10)
        reply = holder.recv_reply(holder.send_get([k[2].redis_key]))
        assert reply["op"] == "shm" and reply["lease"] > 0 and reply["sizes"] == [BLOCK]
        t_pinned = time.monotonic()
        assert c.stat("leases")["pinned"] == [k[2].redis_key]
        # k2 is now the most recent; four puts evict everything else, never k2
        for i in (4, 5, 6, 7):
            assert c.put_blocks(k[i:i + 1], blocks[i:i + 1]) == 1
        assert c.contains([k[2]]) == [True]
        assert c.stat("leases")["pinned"] == [k[2].redis_key]
        # only the connection that got the lease can release it
        other = CtlChannel(address, timeout_s=10)
        other.release(reply["lease"])
        # A reply on the same connection comes after the node handled the release
        # (one reader per connection): no sleep needed to observe its effect.
        assert other.recv_reply(other.send_get([]))["lease"] == 0
        other.close()
        assert c.stat("leases")["pinned"] == [k[2].redis_key]
        # the slot still holds k2's bytes (read through the segment, as a client does)
        mapping = c.aio.shm.mapping(info)
        off = reply["offsets"][0]
        assert bytes(mapping.array[off:off + BLOCK]) == bytes(blocks[2].view(torch.uint8)
                                                              .numpy().reshape(-1))
        # no release: the lease expires after ~3 s, on the same (live) connection
        poll(lambda: c.stat("leases")["pinned"] == [], timeout_s=10)
        assert time.monotonic() - t_pinned > 2
        assert "lease_expired" in node.metrics_text()
        assert c.put_blocks(k[:1], blocks[:1]) == 1  # k2, the LRU block, is evictable again
        assert c.contains([k[2]]) == [False]
        holder.close()
    finally:
        c.close()
        node.stop()


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if "tandem" in f}


def test_shm_segment_never_leaks(store_url: str, tmp_path) -> None:
    """The pool segment has no /dev/shm name, and is gone with the node (stop or kill)."""
    before = _shm_files()
    c = KVStoreClient(store_url)
    try:
        for end in ("stop", "kill"):
            node = StoreNodeProcess(store_url, f"leak-{end}", 1 << 20, heartbeat_ttl_s=1.5,
                                    log_dir=tmp_path)
            node.wait_ready(c)
            info = c.live_nodes()[f"leak-{end}"]
            assert info.shm_path == f"/proc/{node.proc.pid}/fd/" + info.shm_path.split("/")[-1]
            assert os.path.exists(info.shm_path) and _shm_files() == before
            keys = BF16.keys(hashes(f"leak-{end}", 2))
            blocks = random_blocks(BF16, 2, 17)
            assert c.put_blocks(keys, blocks) == 2
            into = [torch.empty_like(b) for b in blocks]
            shm_gets = c.num_shm_reads
            assert c.get_blocks(keys, into) == 2 and c.num_shm_reads == shm_gets + 1
            node.stop() if end == "stop" else node.kill()
            assert not os.path.exists(info.shm_path)
            poll(lambda: f"leak-{end}" not in c.live_nodes())  # noqa: B023
            # the client let go of its mapping too (the segment's memory is freed)
            assert f"leak-{end}" not in c.aio.shm.mapped_node_ids()
            assert _shm_files() == before
            node.stop()
    finally:
        c.close()


@pytest.mark.parametrize("thread", ["caller", "loop"])
def test_same_host_reads_count_only_what_the_index_places(store_url: str, nodes,
                                                          thread: str) -> None:
    """Same-host gets over one or two nodes; blocks count only where the index places
    them and the node holds them; nothing stays pinned. Both on the caller's thread
    (KVStoreClient) and on the client loop (AsyncKVStoreClient)."""
    c = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=True))
    c2 = KVStoreClient(store_url, local_node="n2", options=ClientOptions(shm=True))
    r = redis.Redis.from_url(store_url)
    aio = c.aio

    def get(keys: list[BlockKey], into: list[torch.Tensor]) -> int:
        return c.get_blocks(keys, into) if thread == "caller" else c.run(aio.get(keys, into))

    try:
        keys = BF16.keys(hashes(f"spec-{thread}", 6))
        blocks = random_blocks(BF16, 6, 19)
        assert c.put_blocks(keys[:3], blocks[:3]) == 3
        assert c2.put_blocks(keys[3:], blocks[3:]) == 3
        into = [torch.empty_like(b) for b in blocks]
        assert get(keys[:3], into[:3]) == 3  # n1
        assert c.num_shm_reads == 1
        for _ in range(2):
            into = [torch.empty_like(b) for b in blocks]
            assert get(keys, into) == 6  # n1 and n2
            assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
        assert c.num_shm_reads == 5  # one per node and get
        assert get(keys[3:], into[3:]) == 3  # only n2's blocks
        poll(lambda: c.stat("n1")["pinned"] == [] and c.stat("n2")["pinned"] == [])

        # an index entry whose payload is not on the node (a commit marker without bytes):
        # a miss, and cleaned up
        ghost = BF16.keys(hashes(f"spec-ghost-{thread}", 1))[0]
        slot = int(r.get(keys[0].redis_key).decode().split("|")[1])
        r.set(ghost.redis_key, f"n1|{slot}|{BLOCK}|0123456789abcdef")
        got = get([*keys[:2], ghost], [torch.empty_like(b) for b in blocks[:3]])
        assert got == 2
        assert r.get(ghost.redis_key) is None  # the ghost entry was cleaned up
        assert get(keys[:3], into[:3]) == 3
        # the node also holds blocks past the index's leading ones (an entry gone from
        # the index): never counted
        r.delete(keys[1].redis_key)
        assert get(keys[:3], into[:3]) == 1
        poll(lambda: c.stat("n1")["pinned"] == [])
    finally:
        r.close()
        c.close()
        c2.close()


def test_shm_channel_closed_releases_its_pins(store_url: str, nodes) -> None:
    """Pins taken over the same-host control socket (kvstore/shm_ctl.py) go away as
    soon as the connection closes (a crashed client), not at the lease's expiry;
    bad requests on it are answered with errors and the node keeps serving."""
    from tandem.kvstore.shm_ctl import CtlChannel, ctl_address

    c = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=True))
    try:
        keys = BF16.keys(hashes("ctl-close", 2))
        blocks = random_blocks(BF16, 2, 23)
        assert c.put_blocks(keys, blocks) == 2
        info = c.live_nodes()["n1"]
        ch = CtlChannel(ctl_address(info.node_id, info.shm_id), timeout_s=10)
        reply = ch.recv_reply(ch.send_get([k.redis_key for k in keys] + ["tandem:kv:blk:nope"]))
        assert reply["op"] == "shm" and reply["lease"] > 0
        assert reply["sizes"] == [BLOCK, BLOCK, 0] and reply["offsets"][2] == -1
        assert sorted(c.stat("n1")["pinned"]) == sorted(k.redis_key for k in keys)
        bad = ch.recv_reply(ch.send_get("not a list"))  # type: ignore[arg-type]
        assert bad["op"] == "error" and "list of key strings" in bad["error"]
        ch.close()
        poll(lambda: c.stat("n1")["pinned"] == [])
        into = [torch.empty_like(b) for b in blocks]
        assert c.get_blocks(keys, into) == 2
        assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    finally:
        c.close()


def test_shm_off_or_not_mappable_reads_over_ucx(store_url: str, tmp_path) -> None:
    node = StoreNodeProcess(store_url, "private", 1 << 20, log_dir=tmp_path,
                            extra_args=("--no-shm",))
    c = KVStoreClient(store_url, local_node="private")
    try:
        node.wait_ready(c)
        info = c.live_nodes()["private"]
        assert info.shm_path == "" and info.host_id  # a node started with --no-shm
        keys = BF16.keys(hashes("private", 3))
        blocks = random_blocks(BF16, 3, 18)
        assert c.put_blocks(keys, blocks) == 3
        into = [torch.empty_like(b) for b in blocks]
        assert c.get_blocks(keys, into) == 3 and c.num_shm_reads == 0
        assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
        # no segment to map: the same-host reader declines it
        assert c.aio.shm.mapping(info) is None
        assert c.aio.shm.read(info, [k.redis_key for k in keys], []) is None
        assert c.get_blocks(keys, into) == 3
    finally:
        c.close()
        node.stop()

    # shared-memory reads off: no same-host reader at all
    off = KVStoreClient(store_url, options=ClientOptions(shm=False))
    assert off.aio.shm is None and off.num_shm_reads == 0
    off.close()
    # a node on another host, or a segment that is not the advertised one: UCX
    shm_node = StoreNodeProcess(store_url, "shared", 1 << 20, log_dir=tmp_path)
    c = KVStoreClient(store_url)
    try:
        shm_node.wait_ready(c)
        info = c.live_nodes()["shared"]
        assert c.aio.shm.mapping(info) is not None
        assert c.aio.shm.mapping(replace(info, node_id="x", host_id="elsewhere")) is None
        dev, ino, size = info.shm_id.split(":")
        other_file = replace(info, node_id="y", shm_id=f"{dev}:{int(ino) + 1}:{size}")
        assert c.aio.shm.mapping(other_file) is None
        assert c.aio.shm.mapping(replace(info, node_id="z", shm_path="/proc/1/fd/999999")) is None
    finally:
        c.close()
        shm_node.stop()


def test_clean_stop_withdraws_node_and_entries(store_url: str, tmp_path) -> None:
    node = StoreNodeProcess(store_url, "leaver", 1 << 20, log_dir=tmp_path)
    c = KVStoreClient(store_url, local_node="leaver")
    r = redis.Redis.from_url(store_url)
    try:
        node.wait_ready(c)
        keys = BF16.keys(hashes("leaver", 2))
        assert c.put_blocks(keys, random_blocks(BF16, 2, 15)) == 2
        assert r.exists(*(k.redis_key for k in keys)) == 2
        node.stop()
        assert node.proc.returncode == 0
        assert "leaver" not in c.live_nodes()
        assert r.exists(*(k.redis_key for k in keys)) == 0
    finally:
        r.close()
        c.close()
        node.stop()


def test_block_ttl_expiry(store_url: str, tmp_path) -> None:
    node = StoreNodeProcess(store_url, "ttl", 1 << 20, log_dir=tmp_path)
    c = KVStoreClient(store_url, local_node="ttl")
    try:
        node.wait_ready(c)
        keys = BF16.keys(hashes("ttl", 2))
        blocks = random_blocks(BF16, 2, 9)
        assert c.put_blocks(keys[:1], blocks[:1], ttl_s=0.5) == 1
        assert c.put_blocks(keys[1:], blocks[1:]) == 1
        poll(lambda: c.contains(keys) == [False, True])
        poll(lambda: c.stat("ttl")["num_blocks"] == 1)
    finally:
        c.close()
        node.stop()


@pytest.mark.timeout(60)
def test_killed_node_is_a_miss_at_once(store_url: str, tmp_path, read_path: str) -> None:
    """Bug: after a node's SIGKILL every get of its blocks waited the client's whole
    timeout until the node's heartbeat expired. Now its process being gone (its segment's
    /proc path), or a refused or reset connection, marks it down: its blocks are misses
    at once. The client's timeout is far beyond the test's, so a wait fails the test."""
    node = StoreNodeProcess(store_url, "doomed", 1 << 20, heartbeat_ttl_s=1.5,
                            log_dir=tmp_path)
    c = KVStoreClient(store_url, local_node="doomed", timeout_s=600,
                      options=ClientOptions(shm=read_path == "shm"))
    try:
        node.wait_ready(c)
        keys = BF16.keys(hashes(f"doomed-{read_path}", 3))
        blocks = random_blocks(BF16, 3, 10)
        assert c.put_blocks(keys, blocks) == 3
        into = [torch.empty_like(b) for b in blocks]
        assert c.get_blocks(keys, into) == 3
        assert used_path(c, 0) == read_path
        node.kill()
        assert "doomed" in c.live_nodes(), "its heartbeat has not expired yet"
        assert c.get_blocks(keys, into) == 0
        assert c.get_blocks(keys, into) == 0  # down: not even tried again
        assert c.lookup(keys) == 0
        poll(lambda: "doomed" not in c.live_nodes())  # heartbeat expired
        assert c.get_blocks(keys, into) == 0
        r = redis.Redis.from_url(store_url)
        assert r.exists(*(k.redis_key for k in keys)) == 0  # the dead entries were removed
        r.close()
    finally:
        c.close()
        node.stop()


#: a client in a process of its own (UCX's transports are fixed per process): puts and
#: gets 3 blocks of a node over UCX, then, after each line read from stdin, gets them again
_TCP_CLIENT = """
import sys
import numpy as np
from tandem.contracts.block_key import BlockKey
from tandem.kvstore.client import ClientOptions, KVStoreClient
url, node = sys.argv[1:3]
c = KVStoreClient(url, local_node=node, timeout_s=600, options=ClientOptions(shm=False))
keys = [BlockKey(bytes([i]) * 32, b"f" * 16) for i in range(3)]
blocks = [np.full(32768, i, dtype=np.uint8) for i in range(3)]
into = [np.zeros(32768, dtype=np.uint8) for _ in range(3)]
print("got", c.put_blocks(keys, blocks), c.get_blocks(keys, into), flush=True)
for _ in sys.stdin:
    print("got", c.get_blocks(keys, into), c.aio.down.num_marked, flush=True)
"""


def _answer(out) -> list[str]:  # noqa: ANN001 - a text stream
    """The next answer of the _TCP_CLIENT process (UCX logs to its stdout too)."""
    while not (line := out.readline()).startswith("got ") and line:
        pass
    return line.split()[1:]


@pytest.mark.timeout(60)
def test_killed_node_over_tcp_resets_the_connection_and_is_a_miss(
        store_url: str, tmp_path, monkeypatch) -> None:
    """A node elsewhere (here: one without a shared segment, over UCX's TCP transport)
    is found gone by its connection: the reset marks it down and its blocks are misses
    at once, not after the client's timeout (600 s, beyond the test's)."""
    import subprocess
    import sys

    monkeypatch.setenv("UCX_TLS", "tcp")
    node = StoreNodeProcess(store_url, "tcp-doomed", 1 << 20, log_dir=tmp_path,
                            extra_args=("--no-shm",))
    proc = None
    try:
        with KVStoreClient(store_url) as c:
            node.wait_ready(c)
        proc = subprocess.Popen([sys.executable, "-c", _TCP_CLIENT, store_url, "tcp-doomed"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        assert _answer(proc.stdout) == ["3", "3"]
        node.kill()
        proc.stdin.write("get\n")
        proc.stdin.flush()
        assert _answer(proc.stdout) == ["0", "1"], "a miss, the node marked down"
        proc.stdin.write("get\n")
        proc.stdin.flush()
        assert _answer(proc.stdout) == ["0", "1"], "down: not tried again"
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        node.stop()


def test_redis_restart_nodes_reregister_and_clients_reconnect(tmp_path) -> None:
    from ports import free_port
    from redis_server import RedisServer

    redis_srv = RedisServer(free_port())
    redis_srv.start()
    node = StoreNodeProcess(redis_srv.url, "phoenix", 1 << 20, heartbeat_ttl_s=1.5,
                            log_dir=tmp_path)
    c = KVStoreClient(redis_srv.url, local_node="phoenix", timeout_s=5)
    try:
        node.wait_ready(c)
        keys = BF16.keys(hashes("phoenix", 3))
        blocks = random_blocks(BF16, 3, 11)
        assert c.put_blocks(keys[:2], blocks[:2]) == 2
        redis_srv.restart()
        # while the index is empty the blocks are misses, not errors
        assert c.lookup(keys[:2]) in (0, 2)
        node.wait_ready(c)  # re-registered by its heartbeat
        # the node re-publishes what it holds; the client reconnected to Redis
        poll(lambda: c.lookup(keys[:2]) == 2)
        assert c.put_blocks(keys[2:], blocks[2:]) == 1
        into = [torch.empty_like(b) for b in blocks]
        assert c.get_blocks(keys, into) == 3
        assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    finally:
        c.close()
        node.stop()
        redis_srv.stop()


def test_no_live_node_is_a_clear_error(tmp_path) -> None:
    from ports import free_port
    from redis_server import RedisServer

    redis_srv = RedisServer(free_port())
    redis_srv.start()
    c = KVStoreClient(redis_srv.url, timeout_s=2)
    try:
        with pytest.raises(KVStoreError, match="no live KV store node"):
            c.put_blocks(BF16.keys(hashes("x", 1)), random_blocks(BF16, 1, 0))
        assert c.lookup(BF16.keys(hashes("x", 1))) == 0
        with pytest.raises(TimeoutError):
            wait_for_nodes(c, 1, timeout_s=0.2)
    finally:
        c.close()
        redis_srv.stop()


def test_block_key_forms_round_trip() -> None:
    k = BF16.key(hashes("k", 1)[0])
    assert BlockKey.from_str(str(k)) == k
    assert BlockKey.from_bytes(k.to_bytes()) == k
    assert k.redis_key.endswith(str(k))
    with pytest.raises(ValueError, match="not hex"):
        BlockKey.from_str("zz:yy")
    assert isinstance(np.frombuffer(k.hash, dtype=np.uint8), np.ndarray)
    assert time.monotonic() > 0


# -- same-host reads on the caller's thread (kvstore/shm_read.py): regressions -------------


def put_and_read_two(c: KVStoreClient, tag: str) -> tuple[list[BlockKey], list[torch.Tensor]]:
    """Put two fresh blocks and read them back once (the client's first same-host get)."""
    keys = BF16.keys(hashes(tag, 2))
    blocks = random_blocks(BF16, 2, len(tag))
    assert c.put_blocks(keys, blocks) == 2
    into = [torch.empty_like(b) for b in blocks]
    assert c.get_blocks(keys, into) == 2
    assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    return keys, into


def test_hung_node_times_out_then_its_blocks_are_misses(store_url: str, tmp_path) -> None:
    """A node that stops answering (SIGSTOP) fails the get with a timeout; once its
    heartbeat expired its blocks are misses, without waiting on it again."""
    import signal

    node = StoreNodeProcess(store_url, "frozen", 1 << 20, heartbeat_ttl_s=1.5, log_dir=tmp_path)
    c = KVStoreClient(store_url, local_node="frozen", timeout_s=1.5)
    stopped = False
    try:
        node.wait_ready(c)
        keys, into = put_and_read_two(c, "frozen")
        assert c.num_shm_reads == 1
        os.kill(node.proc.pid, signal.SIGSTOP)
        stopped = True
        with pytest.raises(KVStoreTimeoutError):
            c.get_blocks(keys, into)
        poll(lambda: "frozen" not in c.live_nodes(), timeout_s=15)
        assert c.get_blocks(keys, into) == 0  # its blocks are misses now
    finally:
        if stopped:
            os.kill(node.proc.pid, signal.SIGCONT)
        c.close()
        node.stop()


def test_more_keys_than_one_control_message_holds(store_url: str, nodes) -> None:
    """A get_shm that does not fit one control message is not sent: the get goes over
    UCX instead of raising (before: ValueError from the second get on)."""
    c = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=True))
    try:
        keys = BF16.keys(hashes("many-keys", 10_004))
        blocks = random_blocks(BF16, 4, 31)
        assert c.put_blocks(keys[:4], blocks) == 4
        for _ in range(3):
            into = [torch.empty_like(blocks[0]) for _ in keys]
            assert c.get_blocks(keys, into) == 4
            assert all(same_bits(a, b) for a, b in zip(blocks, into[:4], strict=True))
        assert c.num_shm_reads == 3  # the get_shm names the leading four only
    finally:
        c.close()


def test_channels_of_exited_threads_are_closed(store_url: str, nodes) -> None:
    """Each thread has its own channel to a node; a thread's channel goes (and its
    socket closes) with the thread, not only at close() (before: kept until close)."""
    import gc

    c = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=True))
    try:
        keys = BF16.keys(hashes("threads", 1))
        blocks = random_blocks(BF16, 1, 37)
        assert c.put_blocks(keys, blocks) == 1
        assert c.get_blocks(keys, [torch.empty_like(blocks[0])]) == 1  # this thread's

        def read() -> None:
            assert c.get_blocks(keys, [torch.empty_like(blocks[0])]) == 1

        for _ in range(5):
            t = threading.Thread(target=read)
            t.start()
            t.join()
        gc.collect()
        reader = c.aio.shm
        assert reader is not None and reader.num_channels() == 1  # only this thread's
        info = c.live_nodes()["n1"]
    finally:
        c.close()
    with pytest.raises(KVStoreError, match="closed"):  # none (re)opened once closed
        reader.read(info, [keys[0].redis_key], [np.empty(BLOCK, dtype=np.uint8)])
    assert reader.num_channels() == 0 and reader.mapped_node_ids() == set()


def test_index_unreachable_is_a_miss_without_the_loop_path(tmp_path) -> None:
    """Redis gone: a same-host get reports a miss at once instead of retrying the
    lookup on the client loop (which doubled the wait when Redis hangs)."""
    from ports import free_port
    from redis_server import RedisServer

    redis_srv = RedisServer(free_port())
    redis_srv.start()
    node = StoreNodeProcess(redis_srv.url, "lonely", 1 << 20, log_dir=tmp_path)
    c = KVStoreClient(redis_srv.url, local_node="lonely", timeout_s=2)
    try:
        node.wait_ready(c)
        keys, into = put_and_read_two(c, "lonely")
        loop_gets = []
        real_get = c.aio.get

        async def counting_get(*args, **kwargs):
            loop_gets.append(1)
            return await real_get(*args, **kwargs)

        c.aio.get = counting_get  # a spy: counts, changes nothing
        redis_srv.stop()
        assert c.get_blocks(keys, into) == 0
        assert loop_gets == []
    finally:
        c.close()
        node.stop()
        redis_srv.stop()


@pytest.mark.parametrize("read_path", ["shm", "ucx"])
def test_overlapping_buffers_are_refused_and_the_index_kept(store_url: str, nodes,
                                                             read_path: str) -> None:
    """Two keys read into one buffer is a ValueError (before: the second block failed
    its checksum there, and the intact block's index entry was removed for everyone)."""
    c = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=read_path == "shm"))
    try:
        keys = BF16.keys(hashes(f"alias-{read_path}", 2))
        blocks = random_blocks(BF16, 2, 43)
        assert c.put_blocks(keys, blocks) == 2
        buf = torch.empty_like(blocks[0])
        with pytest.raises(ValueError, match=r"into\[0\] and into\[1\] overlap"):
            c.get_blocks(keys, [buf, buf])
        whole = torch.empty(2 * BLOCK // 2, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="overlap"):
            c.get_blocks(keys, [whole[: BLOCK // 2], whole[BLOCK // 4: BLOCK // 4 + BLOCK // 2]])
        assert c.lookup(keys) == 2
        into = [torch.empty_like(b) for b in blocks]
        assert c.get_blocks(keys, into) == 2
        assert all(same_bits(a, b) for a, b in zip(blocks, into, strict=True))
    finally:
        c.close()


def test_put_blocks_are_readable_on_the_node_before_their_index_commit(store_url: str,
                                                                       nodes) -> None:
    """While a put's index commit is in flight, the node already serves its blocks: a
    reader that finds the fresh index entry then never takes it for one whose payload
    is gone and removes it (before: the node answered 'absent' until the commit's
    reply came back)."""
    from tandem.kvstore.shm_ctl import CtlChannel, ctl_address

    c = KVStoreClient(store_url, local_node="n1", options=ClientOptions(shm=True))
    r = redis.Redis.from_url(store_url)
    keys = BF16.keys(hashes("commit-window", 1))
    blocks = random_blocks(BF16, 1, 47)
    info = c.live_nodes()["n1"]
    ch = CtlChannel(ctl_address(info.node_id, info.shm_id), timeout_s=10)
    result: list[object] = []
    r.execute_command("CLIENT", "PAUSE", 20_000, "WRITE")  # the node's commit waits
    putter = threading.Thread(target=lambda: result.append(c.put_blocks(keys, blocks)))
    try:
        putter.start()

        def readable() -> bool:
            reply = ch.recv_reply(ch.send_get([keys[0].redis_key]))
            if reply["lease"]:
                ch.release(reply["lease"])
            return reply["offsets"][0] >= 0

        poll(readable, timeout_s=15)
        assert r.get(keys[0].redis_key) is None  # the index entry is not written yet
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        putter.join()
        ch.close()
    assert result == [1] and c.lookup(keys) == 1
    into = [torch.empty_like(blocks[0])]
    assert c.get_blocks(keys, into) == 1 and same_bits(into[0], blocks[0])
    r.close()
    c.close()
