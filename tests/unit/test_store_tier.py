"""The KV store as a shared cache tier, at the engine level: the store connector
(kvstore/connector.py, real transfer threads) over an in-process block store with an
index probe, in engines running a tiny random Llama. Oracle: transformers' greedy output.

- a prefill engine loads the stored blocks beyond its local prefix-cache hit, computes
  only the rest, and the loaded blocks join its prefix cache;
- a decode engine publishes prompt + output blocks of finished requests, so the next turn
  loads them;
- a block gone between the lookup and the load is a miss: recomputed, output unchanged.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import transformers
from engine_steps import run
from tiny_models import as_loaded_model, hf_greedy_steps, tiny_config, tiny_hf_model

from tandem.contracts.block_hash import hash_token_blocks
from tandem.contracts.block_key import BlockKey
from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
)
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.kv_connector import register_connector, unregister_connector
from tandem.engine.model_loader import LoadedModel
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kvstore.connector import build_store_connector
from tandem.kvstore.lookup import IndexProbe

VOCAB = 97
MAX_LEN = 96
BLOCK = 4
_ids = itertools.count()


class ProbedStore:
    """A ``BlockStore`` over a dict plus its index probe (``leading``); records
    every put's keys and every probe call."""

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, object] = {}
        self.puts: list[list[BlockKey]] = []
        self.num_probes = 0
        self.lock = threading.Lock()

    def connect(self) -> ProbedStore:
        return self

    def leading(self, keys: Sequence[BlockKey]) -> int:
        self.num_probes += 1
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def put_blocks(self, keys, blocks) -> int:
        with self.lock:
            self.puts.append(list(keys))
            for k, b in zip(keys, blocks, strict=True):
                self.blocks.setdefault(k, b.clone())
        return len(keys)

    def get_blocks(self, keys, into) -> int:
        for i, k in enumerate(keys):
            block = self.blocks.get(k)
            if block is None:
                return i
            into[i].copy_(block)
        return len(keys)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tiny() -> tuple[LoadedModel, transformers.PreTrainedModel]:
    config = tiny_config("LlamaForCausalLM", vocab=VOCAB, hidden=32, ffn=64, max_len=MAX_LEN,
                         special_tokens=False)
    hf = tiny_hf_model(config, std=0.3)
    return as_loaded_model(hf, "tiny-llama", MAX_LEN), hf


@pytest.fixture
def store() -> Iterator[ProbedStore]:
    s = ProbedStore()
    register_connector(
        "probed-store",
        lambda cfg, layout: build_store_connector(
            cfg.kv_role, layout, s.connect, 1, probe=lambda keys: s.leading(keys),
            publish_output=cfg.kv_role == "kv_consumer"),
    )
    register_connector(
        "probed-store-no-lookup",
        lambda cfg, layout: build_store_connector(cfg.kv_role, layout, s.connect, 1),
    )
    yield s
    unregister_connector("probed-store")
    unregister_connector("probed-store-no-lookup")


def make_core(loaded: LoadedModel, role: str, name: str = "probed-store") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        kv_transfer=KVTransferConfig(kv_connector=name, kv_role=role),
    )
    return EngineCore(config, create_executor(config, loaded))


def generate(core: EngineCore, prompt: list[int], n: int) -> tuple[list[int], int]:
    """Greedy tokens of ``prompt`` on ``core`` and the first output's cached tokens."""
    req = Request(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    outs = run(core, req)[req.request_id]
    return [t for o in outs for t in o.new_token_ids], outs[0].num_cached_tokens


def keys_of(core: EngineCore, tokens: list[int]) -> list[BlockKey]:
    return core.layout.keys(hash_token_blocks(tokens, BLOCK))


def test_a_prefill_loads_what_another_computed_and_computes_only_the_rest(tiny, store) -> None:
    loaded, hf = tiny
    a, b = make_core(loaded, "kv_producer"), make_core(loaded, "kv_producer")
    try:
        prompt = list(range(30, 52))  # 22 tokens: 5 full blocks, a partial one
        want = hf_greedy_steps(hf, prompt, 1)[0]
        assert generate(a, prompt, 1) == (want, 0)
        assert a.get_stats().connector_prefix_cache_hits == 0

        # B: its own cache is cold; the store holds all 5 full blocks (the last token is
        # computed here whatever the store holds).
        assert generate(b, prompt, 1) == (want, 20)
        stats = b.get_stats()
        assert (stats.prefix_cache_hits, stats.connector_prefix_cache_hits) == (0, 20)
        assert stats.connector_prefix_cache_queries == len(prompt)
        # Its publish resent none of the 5 blocks it loaded: only the partial tail.
        assert len(store.puts[-1]) == 1

        # A longer prompt sharing the prefix: the loaded blocks joined B's prefix cache.
        longer = prompt[:20] + list(range(60, 75))
        assert generate(b, longer, 1) == (hf_greedy_steps(hf, longer, 1)[0], 20)
        stats = b.get_stats()
        assert (stats.prefix_cache_hits, stats.connector_prefix_cache_hits) == (20, 20)
    finally:
        a.shutdown()
        b.shutdown()


def test_the_lookup_is_one_probe_per_admission_and_off_without_a_probe(tiny, store) -> None:
    loaded, hf = tiny
    a = make_core(loaded, "kv_producer")
    c = make_core(loaded, "kv_producer", "probed-store-no-lookup")
    try:
        prompt = list(range(10, 30))
        generate(a, prompt, 1)
        assert store.num_probes == 1
        assert generate(c, prompt, 1) == (hf_greedy_steps(hf, prompt, 1)[0], 0)
        assert c.get_stats().connector_prefix_cache_hits == 0
        assert store.num_probes == 1
    finally:
        a.shutdown()
        c.shutdown()


def test_a_decode_publishes_prompt_and_output_and_the_next_turn_loads_them(tiny, store
                                                                           ) -> None:
    loaded, hf = tiny
    decode, prefill = make_core(loaded, "kv_consumer"), make_core(loaded, "kv_producer")
    try:
        turn1 = list(range(40, 50))
        answer, _ = generate(decode, turn1, 10)
        assert answer == hf_greedy_steps(hf, turn1, 10)[0]
        # 19 tokens have KV (the last sampled one has none): 4 full blocks published.
        computed = turn1 + answer[:-1]
        assert set(keys_of(decode, computed)) <= set(store.blocks)
        assert len(store.blocks) == 4

        turn2 = turn1 + answer + list(range(80, 86))
        got, cached = generate(prefill, turn2, 1)
        assert got == hf_greedy_steps(hf, turn2, 1)[0]
        assert cached == 16, "turn 1's prompt and answer blocks come from the store"
        assert prefill.get_stats().connector_prefix_cache_hits == 16
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_a_block_gone_between_lookup_and_load_is_recomputed(tiny, store) -> None:
    loaded, hf = tiny
    a, b = make_core(loaded, "kv_producer"), make_core(loaded, "kv_producer")
    try:
        prompt = list(range(5, 30))
        generate(a, prompt, 1)
        keys = keys_of(a, prompt)
        leading = store.leading

        def lookup_then_evict(ks: Sequence[BlockKey]) -> int:
            n = leading(ks)
            del store.blocks[keys[2]]  # evicted after the index said it was there
            return n

        store.leading = lookup_then_evict  # type: ignore[method-assign]
        got, cached = generate(b, prompt, 1)
        assert got == hf_greedy_steps(hf, prompt, 1)[0]
        assert cached == 8, "blocks 0-1 loaded, the rest recomputed"
        stats = b.get_stats()
        assert stats.num_kv_load_failures == 1
        assert stats.connector_prefix_cache_hits == 8
    finally:
        a.shutdown()
        b.shutdown()


def test_the_index_probe_treats_an_unreachable_index_as_a_miss_and_backs_off() -> None:
    from ports import free_port

    probe = IndexProbe(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, backoff_s=60)
    key = BlockKey(b"h" * 32, b"f" * 16)
    try:
        assert probe.leading([key]) == 0
        assert (probe.num_lookups, probe.num_failures) == (1, 1)
        assert probe.leading([key]) == 0
        assert probe.num_lookups == 1, "no lookup while backing off"
    finally:
        probe.close()
    with pytest.raises(ValueError, match="timeout_s"):
        IndexProbe("redis://x", timeout_s=0)


def test_a_slow_lookup_holds_only_its_own_request(tiny, store) -> None:
    """The lookup runs off the step loop: while it hangs, another request runs to the end;
    once it answers, the waiting request loads and finishes with the oracle's tokens."""
    loaded, hf = tiny
    a, b = make_core(loaded, "kv_producer"), make_core(loaded, "kv_producer")
    try:
        prompt = list(range(50, 70))
        generate(a, prompt, 1)
        release = threading.Event()
        leading = store.leading

        def slow(keys: Sequence[BlockKey]) -> int:
            release.wait(30)
            return leading(keys)

        store.leading = slow  # type: ignore[method-assign]
        waiting = Request("waits", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        b.add_request(waiting)
        short = [3, 4, 5]  # no full block: no lookup
        b.add_request(Request("runs", short, SamplingParams(max_tokens=3, temperature=0.0)))
        tokens: dict[str, list[int]] = {"runs": [], "waits": []}
        cached = {}
        finished: set[str] = set()
        while "runs" not in finished:
            for o in b.step():
                tokens[o.request_id] += o.new_token_ids
                cached.setdefault(o.request_id, o.num_cached_tokens)
                if o.finished:
                    finished.add(o.request_id)
        assert tokens["runs"] == hf_greedy_steps(hf, short, 3)[0]
        assert tokens["waits"] == [], "the looked-up request still waits"
        release.set()
        while b.has_unfinished_requests():
            for o in b.step():
                tokens[o.request_id] += o.new_token_ids
                cached.setdefault(o.request_id, o.num_cached_tokens)
        assert tokens["waits"] == hf_greedy_steps(hf, prompt, 1)[0]
        assert cached["waits"] == 16
    finally:
        release.set()
        a.shutdown()
        b.shutdown()


class _LookupEvents:
    """A transfer listener that signals each answered store lookup."""

    def __init__(self) -> None:
        self.answered: dict[str, threading.Event] = {}

    def event(self, request_id: str) -> threading.Event:
        return self.answered.setdefault(request_id, threading.Event())

    def on_save_done(self, request_id: str, result: object) -> None:
        pass

    def on_load_done(self, request_id: str, result: object) -> None:
        pass

    def on_lookup_done(self, request_id: str) -> None:
        self.event(request_id).set()


def test_a_prefetched_lookup_lets_the_first_step_admit_the_request(tiny, store) -> None:
    """The service starts a request's store lookup when it arrives (``prefetch_kv``), so
    the step after ``add_request`` admits it: without the prefetch that step only starts
    the lookup and admission waits one step more."""
    from tandem.engine.request import RequestStatus

    loaded, hf = tiny
    a, b = make_core(loaded, "kv_producer"), make_core(loaded, "kv_producer")
    events = _LookupEvents()
    assert b.connector_worker is not None
    b.connector_worker.set_listener(events)
    try:
        prompt = list(range(12, 34))
        generate(a, prompt, 1)
        probes = store.num_probes
        req = Request("pre", prompt, SamplingParams(max_tokens=2, temperature=0.0))
        b.prefetch_kv(req)
        assert events.event("pre").wait(30)
        b.add_request(req)
        outs = b.step()
        assert b.scheduler.requests["pre"].status != RequestStatus.WAITING
        assert store.num_probes == probes + 1, "the prefetch's answer was used"
        tokens = [t for o in outs for t in o.new_token_ids]
        cached = [o.num_cached_tokens for o in outs]
        while b.has_unfinished_requests():
            for o in b.step():
                tokens += o.new_token_ids
                cached.append(o.num_cached_tokens)
        assert tokens == hf_greedy_steps(hf, prompt, 2)[0]
        assert cached[0] == 20

        # Without a prefetch the first step only starts the lookup.
        again = Request("plain", list(range(12, 30)) + [90, 91, 92],
                        SamplingParams(max_tokens=1, temperature=0.0))
        b.add_request(again)
        b.step()
        assert b.scheduler.requests["plain"].status == RequestStatus.WAITING
        while b.has_unfinished_requests():
            b.step()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_prefetch_answers_later_starts_and_never_another_request() -> None:
    """``_Lookups``: a prefetch from block 0 answers a lookup from a later block inside its
    run; past its run a new lookup starts; a second request object with the same id never
    sees the first one's answer; ``pop`` forgets both states."""
    from tandem.kvstore.connector_lookups import _Lookups

    present = 5
    probed: list[int] = []

    def probe(keys: Sequence[BlockKey]) -> int:
        probed.append(len(keys))
        return min(present, len(keys))

    events = _LookupEvents()
    transfers = type("T", (), {"listener": events})()
    lookups = _Lookups(probe, transfers)  # type: ignore[arg-type]
    chain = [bytes([i]) * 32 for i in range(8)]
    fp = b"f" * 16
    params = SamplingParams(max_tokens=1)
    try:
        first = Request("same", list(range(40)), params)
        lookups.prefetch(first, 8, lambda: chain, fp)
        assert events.event("same").wait(30)
        found = lookups.get(first, 3, 8, lambda: chain, fp)
        assert found is not None and (found.start, found.num_blocks) == (3, 2)
        assert probed == [8]

        other = Request("same", list(range(40)), params)
        events.answered.clear()
        assert lookups.get(other, 3, 8, lambda: chain, fp) is None, "not the first's answer"
        assert events.event("same").wait(30)
        assert probed == [8, 5]
        assert len(lookups) == 2
        assert lookups.pop(other) is not None and len(lookups) == 1

        events.answered.clear()
        assert lookups.get(first, 6, 8, lambda: chain, fp) is None, "past the run: asks again"
        assert events.event("same").wait(30)
        assert lookups.get(first, 6, 8, lambda: chain, fp) is not None
        lookups.pop(first)
        assert len(lookups) == 0
    finally:
        lookups.close()


class _StoreSignal:
    """An ``ArrivalSignal`` over a :class:`ProbedStore`: its index is the store's dict,
    markers live in a dict; ``polled`` is set by the first poll."""

    def __init__(self, store: ProbedStore) -> None:
        self.store = store
        self.markers: dict[str, str] = {}
        self.polled = threading.Event()

    def mark_published(self, marker_key: str, ok: bool) -> None:
        self.markers[marker_key] = "ok" if ok else "failed"

    def poll(self, waits):
        from tandem.kvstore.arrival import Arrival

        self.polled.set()
        out = []
        for keys, marker_key in waits:
            n = next((i for i, k in enumerate(keys) if k not in self.store.blocks), len(keys))
            out.append(Arrival(n, self.markers.get(marker_key)))
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def waiting_store(store: ProbedStore) -> Iterator[tuple[ProbedStore, _StoreSignal]]:
    """``store`` behind a connector whose lookups may wait for an output publish."""
    signal = _StoreSignal(store)
    register_connector(
        "probed-store-wait",
        lambda cfg, layout: build_store_connector(
            cfg.kv_role, layout, store.connect, 1, probe=lambda keys: store.leading(keys),
            publish_output=cfg.kv_role == "kv_consumer", signal=signal, load_wait_s=60.0),
    )
    yield store, signal
    unregister_connector("probed-store-wait")


def _finish_turn_with_publish_held(core: EngineCore, req: Request, release: threading.Event,
                                   store: ProbedStore, fail: bool = False) -> list[int]:
    """Run ``req`` to its last token on ``core`` while its output publish is held at the
    store's put until ``release`` (then it stores the blocks, or raises with ``fail``)."""
    put = store.put_blocks

    def held_put(keys, blocks) -> int:
        release.wait(60)
        if fail:
            raise ConnectionError("store node gone")
        return put(keys, blocks)

    store.put_blocks = held_put  # type: ignore[method-assign]
    core.add_request(req)
    tokens: list[int] = []
    done = False
    while not done:
        for o in core.step():
            tokens += o.new_token_ids
            done = done or o.finished
    return tokens


@pytest.mark.parametrize("publish_fails", [False, True])
def test_the_next_turn_waits_for_the_previous_answers_publish(tiny, waiting_store,
                                                              publish_fails) -> None:
    """A chat's next turn reaching the store lookup while the previous answer's output
    publish still runs (the answer already streamed out) waits for it, as the router's
    ``kv_publish_in_flight`` hint says, instead of recomputing the answer: the lookup
    parks until the blocks are in the index (then 16 cached tokens), or until the
    publish's end marker says it failed (then all is computed); tokens equal the
    oracle's either way."""
    from tandem.contracts.block_key import PublishInFlight
    from tandem.engine.request import RequestStatus

    store, signal = waiting_store
    loaded, hf = tiny
    decode = make_core(loaded, "kv_consumer", "probed-store-wait")
    prefill = make_core(loaded, "kv_producer", "probed-store-wait")
    release = threading.Event()
    try:
        turn1 = list(range(40, 50))
        first = Request("turn-1", turn1, SamplingParams(max_tokens=10, temperature=0.0))
        answer = _finish_turn_with_publish_held(decode, first, release, store, publish_fails)
        assert answer == hf_greedy_steps(hf, turn1, 10)[0]
        assert store.blocks == {}, "the publish is still held"

        turn2 = turn1 + answer + list(range(80, 86))
        hint = PublishInFlight("turn-1", decode.layout.fingerprint, BLOCK, 0, 4)
        nxt = Request("turn-2", turn2, SamplingParams(max_tokens=1, temperature=0.0),
                      kv_publish_in_flight=hint)
        prefill.add_request(nxt)
        prefill.step()  # asks the index: the answer's blocks are missing, so it parks
        assert signal.polled.wait(30), "the lookup waits for the publish"
        assert prefill.step() == []
        assert prefill.scheduler.requests["turn-2"].status == RequestStatus.WAITING

        release.set()
        tokens, cached = [], []
        while prefill.has_unfinished_requests():
            for o in prefill.step():
                tokens += o.new_token_ids
                cached.append(o.num_cached_tokens)
        assert tokens == hf_greedy_steps(hf, turn2, 1)[0]
        assert cached[0] == (0 if publish_fails else 16)
        outcome = "publish_failed" if publish_fails else "arrived"
        assert prefill.connector_worker.lookup_waits == {outcome: 1}
    finally:
        release.set()
        decode.shutdown()
        prefill.shutdown()


def _waiting_lookups(probe: Callable[[Sequence[BlockKey]], int], wait_s: float
                     ) -> tuple[Any, _LookupEvents, _StoreSignal]:
    """``_Lookups`` over ``probe`` with an arrival signal and ``kv_load_wait_s`` of
    ``wait_s``, block size 4: (the lookups, their answer events, the signal)."""
    from tandem.kvstore.connector_lookups import _Lookups

    events = _LookupEvents()
    signal = _StoreSignal(ProbedStore())
    transfers = type("T", (), {"listener": events, "signal": signal, "load_wait_s": wait_s})()
    return _Lookups(probe, transfers, 4), events, signal  # type: ignore[arg-type]


def test_a_lookup_waits_only_for_blocks_its_hint_names() -> None:
    """``_Lookups`` with an arrival signal: no hint, a hint of another layout or block
    size, or a miss before the hinted blocks answer at once; a miss inside them waits
    (once) and asks again when it ends."""
    from tandem.contracts.block_key import PublishInFlight

    present = 3
    probed: list[int] = []

    def probe(keys: Sequence[BlockKey]) -> int:
        probed.append(len(keys))
        return min(present, len(keys))

    lookups, events, signal = _waiting_lookups(probe, 60.0)
    chain = [bytes([i]) * 32 for i in range(8)]
    fp = b"f" * 16
    params = SamplingParams(max_tokens=1)

    def answered(hint: PublishInFlight | None, name: str) -> bool:
        req = Request(name, list(range(40)), params, kv_publish_in_flight=hint)
        events.answered.clear()
        lookups.prefetch(req, 8, lambda: chain, fp)
        # a parked lookup answers only at its 60 s deadline (no marker comes), so an
        # answer within 30 s means it did not park
        got = events.event(name).wait(30)
        lookups.pop(req)
        return got

    try:
        assert answered(None, "plain")
        assert answered(PublishInFlight("t", b"x" * 16, 4, 2, 6), "other-layout")
        assert answered(PublishInFlight("t", fp, 8, 2, 6), "other-block-size")
        assert answered(PublishInFlight("t", fp, 4, 4, 6), "miss-before-the-hint")
        assert lookups.wait_outcomes == {}

        signal.markers["tandem:kv:outdone:" + fp.hex() + ":t"] = "ok"
        req = Request("waits", list(range(40)), params,
                      kv_publish_in_flight=PublishInFlight("t", fp, 4, 2, 6))
        events.answered.clear()
        probed.clear()
        lookups.prefetch(req, 8, lambda: chain, fp)
        assert events.event("waits").wait(30)
        assert lookups.wait_outcomes == {"published": 1}
        assert probed == [8, 8], "asked again after the wait"
        found = lookups.pop(req)
        assert found is not None and found.num_blocks == present
    finally:
        lookups.close()


def test_a_lookup_parking_as_the_connector_closes_is_still_answered() -> None:
    """Bug pinned: a lookup that tried to park after ``close()`` had stopped the waiter
    came back ("closed") behind the lookup thread's stop mark, and the thread ended
    without answering it."""
    import threading

    from tandem.contracts.block_key import PublishInFlight

    entered, release = threading.Event(), threading.Event()

    def probe(keys: Sequence[BlockKey]) -> int:
        entered.set()
        release.wait(30)
        return min(3, len(keys))

    lookups, events, signal = _waiting_lookups(probe, 60.0)
    chain = [bytes([i]) * 32 for i in range(8)]
    fp = b"f" * 16
    req = Request("closing", list(range(40)), SamplingParams(max_tokens=1),
                  kv_publish_in_flight=PublishInFlight("t", fp, 4, 2, 6))
    lookups.prefetch(req, 8, lambda: chain, fp)
    assert entered.wait(30)
    # close() in the order it runs, with the lookup still probing: the waiter stops, then
    # the thread's stop mark is queued; the lookup then misses inside its hint and parks
    assert lookups._waiter is not None
    lookups._waiter.close()
    lookups._queue.put(None)
    release.set()
    assert events.event("closing").wait(30), "the lookup was never answered"
    assert lookups.wait_outcomes == {"closed": 1}
    found = lookups.pop(req)
    assert found is not None and found.num_blocks == 3
    lookups._thread.join(30)
    assert not lookups._thread.is_alive()


def test_a_request_waits_for_a_publish_at_most_once_across_its_lookups() -> None:
    """A prefetched lookup (from block 0) that waited out its hint's publish and is
    followed by the engine's lookup from the local prefix-cache hit (a later block, past
    the prefetch's leading run) must not wait a second time: the request's wait stays
    within ``kv_load_wait_s`` when the end marker never comes (the decode died), instead
    of twice that."""
    from tandem.contracts.block_key import PublishInFlight
    from tandem.kvstore.connector_lookups import _Lookups

    events = _LookupEvents()
    signal = _StoreSignal(ProbedStore())  # no marker ever: each wait ends at its deadline
    transfers = type("T", (), {"listener": events, "signal": signal, "load_wait_s": 0.05})()
    lookups = _Lookups(lambda keys: min(2, len(keys)), transfers, 4)  # type: ignore[arg-type]
    chain = [bytes([i]) * 32 for i in range(8)]
    fp = b"f" * 16
    req = Request("turn-2", list(range(40)), SamplingParams(max_tokens=1),
                  kv_publish_in_flight=PublishInFlight("gone", fp, 4, 2, 6))
    try:
        lookups.prefetch(req, 8, lambda: chain, fp)
        assert events.event("turn-2").wait(30)
        assert lookups.wait_counts() == {"deadline": 1}
        # the engine's own lookup, from its local hit of blocks 0-2
        events.answered.clear()
        assert lookups.get(req, 3, 8, lambda: chain, fp) is None
        assert events.event("turn-2").wait(30)
        found = lookups.get(req, 3, 8, lambda: chain, fp)
        assert found is not None and found.start == 3
        assert lookups.wait_counts() == {"deadline": 1}, "the request waited twice"
    finally:
        lookups.close()
