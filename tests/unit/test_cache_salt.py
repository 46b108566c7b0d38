"""``cache_salt`` (vLLM's request field): mixed into the first block's hash, so requests
with different salts share no prefix-cache or KV-store block and equal salts do; no salt
(``None`` or ``""``) keeps the unsalted hashes."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kvstore_connector import (  # the store fixture and the connector sides
    BS,
    LAYOUT,
    PROMPT,
    DictBlockStore,
    make_sides,
    store,  # noqa: F401  (a fixture)
)
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model
from transfer_recorder import Recorder
from waiting import wait_until

from tandem.contracts.block_hash import (
    ROOT_HASH,
    hash_block,
    hash_token_blocks,
    prompt_block_hashes,
)
from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.model_loader import LoadedModel
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling_params import SamplingParams

TOKENS = list(range(12))
_ids = itertools.count()


def test_salt_changes_the_first_block_hash_and_so_the_whole_chain() -> None:
    plain = hash_token_blocks(TOKENS, 4)
    salted = hash_token_blocks(TOKENS, 4, cache_salt="tenant-a")
    assert plain == hash_token_blocks(TOKENS, 4, cache_salt=None)
    assert plain == hash_token_blocks(TOKENS, 4, cache_salt="")
    assert salted[0] != plain[0]
    # later blocks inherit the salt through their parent only
    assert salted[1] == hash_block(salted[0], TOKENS[4:8]) != plain[1]
    assert salted == hash_token_blocks(TOKENS, 4, cache_salt="tenant-a")
    assert salted[0] != hash_token_blocks(TOKENS, 4, cache_salt="tenant-b")[0]


def test_unsalted_first_block_hash_is_unchanged() -> None:
    """The unsalted chain keeps its definition, so blocks already in a store stay valid."""
    import hashlib
    import struct

    expected = hashlib.sha256(ROOT_HASH + struct.pack("<4q", *TOKENS[:4])).digest()
    assert hash_block(None, TOKENS[:4]) == expected
    assert hash_block(None, TOKENS[:4], cache_salt="") == expected


def test_prompt_block_hashes_salt_the_partial_only_prompt_too() -> None:
    assert prompt_block_hashes([1, 2], 4, cache_salt="s") != prompt_block_hashes([1, 2], 4)
    assert len(prompt_block_hashes(TOKENS[:10], 4, cache_salt="s")) == 3


def test_salt_on_a_later_block_is_rejected() -> None:
    parent = hash_block(None, TOKENS[:4])
    with pytest.raises(ValueError, match="cache_salt"):
        hash_block(parent, TOKENS[4:8], cache_salt="s")


# -- the engine's prefix cache ----------------------------------------------------------


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    config = tiny_config("LlamaForCausalLM", vocab=97, hidden=32, ffn=64, max_len=64,
                         special_tokens=False)
    return as_loaded_model(tiny_hf_model(config, std=0.3), "tiny-llama", 64)


def cached_tokens(core: EngineCore, prompt: list[int], salt: str | None) -> int:
    """Run one request to completion; its ``num_cached_tokens``."""
    req = Request(f"r{next(_ids)}", prompt, SamplingParams(temperature=0.0, max_tokens=2),
                  cache_salt=salt)
    core.add_request(req)
    cached = None
    while core.has_unfinished_requests():
        for out in core.step():
            if out.new_token_ids and cached is None:
                cached = out.num_cached_tokens
    assert cached is not None
    return cached


def test_prefix_cache_is_shared_only_within_a_salt(loaded) -> None:
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=4, num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
    )
    core = EngineCore(config, create_executor(config, loaded))
    prompt = list(range(1, 14))  # 3 full blocks before the last token
    assert cached_tokens(core, prompt, "tenant-a") == 0
    assert cached_tokens(core, prompt, "tenant-b") == 0  # another salt: nothing shared
    assert cached_tokens(core, prompt, None) == 0  # unsalted: nothing shared either
    assert cached_tokens(core, prompt, "tenant-a") == 12  # the same salt: cached
    assert cached_tokens(core, prompt, "") == 12  # "" is unsalted, as None


# -- the KV store -----------------------------------------------------------------------


def test_a_salted_publish_is_stored_under_salted_keys(store: DictBlockStore) -> None:  # noqa: F811
    producer, worker, kv = make_sides("kv_producer")
    events = Recorder()
    worker.set_listener(events)
    req = Request("p", PROMPT, SamplingParams(max_tokens=1), cache_salt="tenant-a")
    req.num_computed_tokens = len(PROMPT)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    try:
        assert producer.request_finished(req, [3, 1, 4])
        wait_until(lambda: "p" in events.saves, 30, "the save")
    finally:
        worker.shutdown()
    salted = LAYOUT.keys(prompt_block_hashes(PROMPT, BS, cache_salt="tenant-a"))
    assert set(store.blocks) == set(salted)
    assert not set(store.blocks) & set(LAYOUT.keys(prompt_block_hashes(PROMPT, BS)))
    assert all(torch.equal(store.blocks[k], kv[b]) for k, b in zip(salted, [3, 1, 4],
                                                                  strict=True))
