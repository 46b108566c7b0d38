"""A decode load waiting for blocks a prefill is still publishing (kvstore/arrival.py).

Both sides of the store connector run over one in-process block store whose puts can be
held back (a prefill's publish still in flight) and an in-process ``ArrivalSignal``; the
transfer and waiter threads are the real ones. The Redis signal itself is exercised by
tests/integration/test_services_early_answer.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch
from test_kvstore_connector import DictBlockStore
from waiting import wait_until

from tandem.contracts.block_hash import prompt_block_hashes
from tandem.contracts.block_key import BlockKey, KVTransferParams
from tandem.contracts.kv_layout import KVCacheLayout
from tandem.engine.kv_connector import KVConnectorScheduler, KVConnectorWorker, LoadResult
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import SchedulerOutput
from tandem.kvstore.arrival import Arrival
from tandem.kvstore.connector import build_store_connector

BS = 4
LAYOUT = KVCacheLayout("tiny", num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32",
                       block_size=BS)
PROMPT = list(range(10))  # 2 full blocks and a partial one
HASHES = tuple(prompt_block_hashes(PROMPT, BS))


class HeldStore(DictBlockStore):
    """A ``DictBlockStore`` whose puts wait for :attr:`release` (a publish in flight);
    ``fail_puts`` makes a released put raise."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        assert self.release.wait(30), "the test never released the put"
        return super().put_blocks(keys, blocks)


class DictSignal:
    """An ``ArrivalSignal`` over :class:`HeldStore`'s keys and a dict of markers."""

    def __init__(self, store: HeldStore) -> None:
        self.store = store
        self.markers: dict[str, str] = {}
        self.num_polls = 0

    def mark_published(self, marker_key: str, ok: bool) -> None:
        self.markers[marker_key] = "ok" if ok else "failed"

    def poll(self, waits: Sequence[tuple[Sequence[BlockKey], str]]) -> list[Arrival]:
        self.num_polls += 1
        out = []
        for keys, marker_key in waits:
            n = 0
            while n < len(keys) and keys[n] in self.store.blocks:
                n += 1
            out.append(Arrival(n, self.markers.get(marker_key)))
        return out

    def close(self) -> None:
        pass


class Loads:
    """A ``TransferListener`` keeping load outcomes."""

    def __init__(self) -> None:
        self.loads: dict[str, LoadResult] = {}

    def on_save_done(self, request_id: str, result: object) -> None:
        pass

    def on_load_done(self, request_id: str, result: LoadResult) -> None:
        self.loads[request_id] = result

    def on_lookup_done(self, request_id: str) -> None:
        pass


Side = tuple[KVConnectorScheduler, KVConnectorWorker, torch.Tensor]


@pytest.fixture
def store() -> HeldStore:
    return HeldStore()


@pytest.fixture
def signal(store: HeldStore) -> DictSignal:
    return DictSignal(store)


def _side(role: str, store: HeldStore, signal: DictSignal, wait_s: float) -> Side:
    sched, worker = build_store_connector(role, LAYOUT, lambda: store, 1, signal=signal,
                                          load_wait_s=wait_s)
    kv = torch.randn(8, *LAYOUT.block_shape)
    worker.register_kv_caches(kv)
    return sched, worker, kv


@pytest.fixture
def producer(store: HeldStore, signal: DictSignal) -> Iterator[Side]:
    side = _side("kv_producer", store, signal, 0)
    yield side
    store.release.set()
    side[1].shutdown()


@pytest.fixture
def consumer(store: HeldStore, signal: DictSignal) -> Iterator[Side]:
    side = _side("kv_consumer", store, signal, 30)
    yield side
    side[1].shutdown()


def _publish(producer: Side, rid: str = "r") -> None:
    """The prefill's request finished: its publish starts (and waits for ``release``)."""
    req = Request(rid, PROMPT, SamplingParams(max_tokens=1))
    req.num_computed_tokens = len(PROMPT)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer[0].request_finished(req, [3, 1, 4])


def _load(consumer: Side, pending: bool, rid: str = "r") -> tuple[Request, Loads]:
    """The decode's request admitted: its load of the prompt's blocks starts."""
    sched, worker, _ = consumer
    events = Loads()
    worker.set_listener(events)
    req = Request(rid, PROMPT, SamplingParams(max_tokens=4))
    req.kv_transfer_params = KVTransferParams(HASHES, LAYOUT.fingerprint, publish_pending=pending)
    assert sched.get_num_new_matched_tokens(req, 0) == len(PROMPT)
    sched.update_state_after_alloc(req, [5, 6, 7], len(PROMPT))
    worker.start_load_kv(sched.build_connector_meta(SchedulerOutput()))
    return req, events


def test_a_load_waits_for_blocks_still_being_published(store, signal, producer, consumer):
    _publish(producer)
    _, events = _load(consumer, pending=True)
    wait_until(lambda: signal.num_polls > 0, 30, "the load parked and polled")
    assert not events.loads, "nothing arrived yet: the load must still wait"
    store.release.set()  # the publish ends
    wait_until(lambda: "r" in events.loads, 30, "the load")
    result = events.loads["r"]
    assert result.complete and result.wait_outcome == "arrived" and result.wait_ns > 0
    assert all(torch.equal(consumer[2][d], producer[2][s]) for d, s in ((5, 3), (6, 1), (7, 4)))
    assert consumer[1].num_load_failures == 0
    assert consumer[1].get_finished() == (set(), {"r": len(PROMPT)})


def test_a_failed_publish_ends_the_wait_and_the_rest_is_recomputed(store, signal, producer,
                                                                   consumer):
    _publish(producer)
    _, events = _load(consumer, pending=True)
    wait_until(lambda: signal.num_polls > 0, 30, "the load parked and polled")
    store.fail_puts = True
    store.release.set()
    wait_until(lambda: "r" in events.loads, 30, "the load")
    result = events.loads["r"]
    assert (result.num_tokens, result.wait_outcome) == (0, "publish_failed")
    assert consumer[1].num_load_failures == 1


def test_a_load_waits_no_longer_than_kv_load_wait_s(store, signal):
    sched, worker, _ = side = _side("kv_consumer", store, signal, 0.05)
    try:
        _, events = _load(side, pending=True)  # no prefill publishes anything
        wait_until(lambda: "r" in events.loads, 30, "the load")
        assert (events.loads["r"].num_tokens, events.loads["r"].wait_outcome) == (0, "deadline")
    finally:
        worker.shutdown()


def test_an_abort_hands_a_waiting_load_back_at_once(store, signal, producer, consumer):
    _publish(producer)
    req, events = _load(consumer, pending=True)
    wait_until(lambda: signal.num_polls > 0, 30, "the load parked and polled")
    req.status = RequestStatus.FINISHED_ABORTED
    assert consumer[0].request_finished(req, [5, 6, 7]), "keep the blocks until it reports"
    finished: dict[str, int] = {}
    wait_until(lambda: finished.update(consumer[1].get_finished()[1]) or "r" in finished, 30,
               "the cancelled load reports")
    assert finished == {"r": 0} and not events.loads  # the listener hears nothing of aborts
    assert consumer[1].num_load_failures == 0


def test_without_publish_pending_a_miss_is_recomputed_at_once(store, signal, consumer):
    _, events = _load(consumer, pending=False)
    wait_until(lambda: "r" in events.loads, 30, "the load")
    assert events.loads["r"].num_tokens == 0 and events.loads["r"].wait_outcome is None
    assert signal.num_polls == 0
