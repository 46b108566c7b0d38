"""Tensor and pipeline parallelism of the model side: ``engine/distributed.py``, the
sharded Llama family and one ``ModelRunner`` per rank, in real processes over gloo.

An engine core drives ranks in worker processes (``tests/tp_ranks.py``: every step to
every rank, the driver's output back) at TP=2, PP=2 and TP=2 x PP=2; float32 greedy
output equals the single-process engine token for token, and the driver's logits equal
its logits to float32 rounding (the TP all-reduce sums in another order), on tiny
configs of every architecture: GQA with KV heads split and replicated (1 KV head at
TP=2), Qwen2's QKV bias, Qwen3's q/k norms, Mistral's sliding window, row-parallel
biases, tied and untied embeddings, a vocabulary that TP=2 pads, an uneven layer split;
the requests run in mixed batches with chunked prefill, prefix caching and preemption.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_steps import run
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model
from tp_ranks import RankExecutor, RankPool

from tandem.engine import distributed
from tandem.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.engine.engine_core import EngineCore
from tandem.engine.executor import create_executor
from tandem.engine.models.sharding import ModelShard
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

MAX_LEN = 64
BLOCK = 4
NUM_BLOCKS = 10  # the second wave outgrows it: a request is preempted

CONFIG = EngineConfig(
    model=ModelConfig(dtype="float32", max_model_len=MAX_LEN),
    cache=CacheConfig(block_size=BLOCK, num_blocks_override=NUM_BLOCKS),
    scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
)


@dataclass(frozen=True)
class Case:
    arch: str
    sizes: dict[str, Any]


CASES = {
    # Llama GQA (2 KV heads: one per rank at TP=2) with o_proj and down_proj biases
    # (row-parallel: added once); vocabulary 101: padded to 102 at TP=2.
    "llama-bias": Case("LlamaForCausalLM", {"vocab": 101, "kv_heads": 2,
                                            "attention_bias": True, "mlp_bias": True}),
    # One KV head: replicated on both TP ranks; tied embeddings.
    "llama-kv1-tied": Case("LlamaForCausalLM", {"vocab": 96, "kv_heads": 1,
                                                "tie_word_embeddings": True}),
    "qwen2-tied": Case("Qwen2ForCausalLM", {"vocab": 101, "kv_heads": 2,
                                            "tie_word_embeddings": True}),
    # An explicit head_dim: the attention width (64) is not the hidden size (32).
    "qwen3": Case("Qwen3ForCausalLM", {"vocab": 97, "kv_heads": 2, "head_dim": 16,
                                       "tie_word_embeddings": False}),
    # 3 layers: stages of 2 and 1 at PP=2; a window shorter than the prompts.
    "mistral-window": Case("MistralForCausalLM", {"vocab": 101, "kv_heads": 2, "layers": 3,
                                                  "sliding_window": 6}),
}
LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tensor_parallel_size, pipeline_parallel_size)

_ids = itertools.count()


def _hf(case: Case):
    sizes = {"hidden": 32, "ffn": 64, "heads": 4, **case.sizes}
    config = tiny_config(case.arch, max_len=MAX_LEN, special_tokens=False, **sizes)
    return tiny_hf_model(config, std=0.3, norms=(0.5, 1.5))


def _waves() -> list[list[Request]]:
    """Two waves of greedy requests: the second's first prompt shares two blocks with
    the first wave's (a prefix cache hit), its 20-token prompt is prefilled in chunks,
    and together they outgrow the pool (a preemption)."""
    def req(prompt: list[int], n: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        return Request(f"r{next(_ids)}", prompt, params)

    shared = [5, 17, 33, 2, 71, 40, 9, 88]
    return [
        [req(shared + [13, 60, 21, 7, 3], 8), req([44, 1, 90, 12, 30], 8)],
        [req(shared + [61, 25, 8], 10), req([(7 * i + 3) % 90 for i in range(20)], 10)],
    ]


@dataclass
class Generated:
    tokens: list[list[int]]  # per request
    num_cached_tokens: list[int]  # per request: prompt tokens served from the prefix cache
    num_preemptions: int
    logits: list[torch.Tensor]  # per logits computation: [rows, vocab] float32


def _generate(core: EngineCore, logits: list[torch.Tensor]) -> Generated:
    tokens, cached = [], []
    for wave in _waves():
        outs = run(core, *wave)
        for r in wave:
            tokens.append([t for o in outs[r.request_id] for t in o.new_token_ids])
            cached.append(max(o.num_cached_tokens for o in outs[r.request_id]))
    return Generated(tokens, cached, core.scheduler.num_preemptions, logits)


@pytest.fixture(scope="module")
def references() -> dict[str, Generated]:
    """Per case: the single-process engine's tokens and logits (per logits call)."""
    refs = {}
    for name, case in CASES.items():
        loaded = as_loaded_model(_hf(case), "tiny", MAX_LEN)
        logits: list[torch.Tensor] = []
        compute_logits = loaded.model.compute_logits

        def recording(hidden, upcast=True, compute_logits=compute_logits, logits=logits):
            out = compute_logits(hidden, upcast)
            logits.append(out.float().clone())
            return out

        loaded.model.compute_logits = recording
        refs[name] = _generate(EngineCore(CONFIG, create_executor(CONFIG, loaded)), logits)
        assert refs[name].num_preemptions > 0, "the requests must outgrow the pool"
        assert refs[name].num_cached_tokens[2] >= 2 * BLOCK, "a prefix cache hit"
    return refs


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    ranks = RankPool(4)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def rendezvous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh ``file://`` rendezvous URL per call."""
    folder: Path = tmp_path_factory.mktemp("rendezvous")
    return (f"file://{folder}/init-{i}" for i in itertools.count())


@contextmanager
def layout(pool: RankPool, rendezvous: Iterator[str], tp: int, pp: int) -> Iterator[range]:
    """Ranks ``0 .. tp * pp - 1`` of ``pool`` in one process group for the block."""
    ranks = range(tp * pp)
    pool.call(ranks, "init", tp, pp, next(rendezvous))
    try:
        yield ranks
    finally:
        if not pool.broken:
            pool.call(ranks, "destroy")


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
def test_parallel_greedy_equals_single_process(pool, rendezvous, references, tp, pp) -> None:
    with layout(pool, rendezvous, tp, pp):
        for name, case in CASES.items():
            hf = _hf(case)
            executor = RankExecutor(pool, tp, pp, CONFIG, hf.config, hf.state_dict(), MAX_LEN)
            got = _generate(EngineCore(CONFIG, executor), [])
            ref = references[name]
            assert got.tokens == ref.tokens, name
            assert got.num_cached_tokens == ref.num_cached_tokens, name
            assert got.num_preemptions == ref.num_preemptions, name
            logits = executor.driver_logits()
            assert len(logits) == len(ref.logits), name
            for got_logits, want in zip(logits, ref.logits, strict=True):
                torch.testing.assert_close(got_logits, want, rtol=1e-4, atol=1e-4, msg=name)
            _check_shards(executor, hf.config, tp, pp)


def _check_shards(executor: RankExecutor, config: Any, tp: int, pp: int) -> None:
    """Each rank's cache holds its stage's layers and its KV heads; the facts the
    engine sees are the full model's."""
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    facts = executor.model_facts
    assert (facts.num_layers, facts.num_kv_heads) == (layers, kv_heads)
    stages: dict[int, list[int]] = {}
    for rank, info in sorted(executor.infos.items()):
        tp_rank = rank % tp
        assert info["is_driver"] == (rank == executor.driver)
        stages.setdefault(tp_rank, []).extend(info["layer_range"])
        heads = info["kv_head_range"]
        assert len(heads) == max(1, kv_heads // tp)
        if kv_heads < tp:  # replicated: the head the rank's query heads read
            head = tp_rank // (tp // kv_heads)
            assert heads == range(head, head + 1)
        shape = executor.kv_shapes[rank]
        assert shape == (NUM_BLOCKS, len(info["layer_range"]), 2, BLOCK, len(heads),
                         facts.head_dim)
        assert (info["num_layers"], info["num_kv_heads"]) == (shape[1], shape[4])
        # the cache budget per rank is in this rank's blocks: its layers and heads only
        assert info["block_bytes"] == 4 * shape[1] * 2 * BLOCK * shape[4] * facts.head_dim
        if pp > 1:
            assert len(info["layer_range"]) < layers, "a stage holds only its layers"
    for tp_rank, covered in stages.items():
        assert covered == list(range(layers)), f"TP rank {tp_rank}'s stages cover every layer"


def test_bad_layouts_fail_at_construction(pool, rendezvous) -> None:
    """In a real process group: a model the layout does not split raises naming the
    field; speculative decoding is refused with several ranks."""
    def error(ranks, hf_config) -> set[str]:
        return set(pool.call(ranks, "model_error", hf_config).values())

    with layout(pool, rendezvous, 2, 1) as ranks:
        three_heads = tiny_config("LlamaForCausalLM", vocab=50, hidden=24, ffn=32, heads=3,
                                  kv_heads=1)
        (msg,) = error(ranks, three_heads)
        assert "tensor_parallel_size 2 must divide num_attention_heads 3" in msg
        three_kv = tiny_config("LlamaForCausalLM", vocab=50, hidden=24, ffn=32, heads=6,
                               kv_heads=3)
        (msg,) = error(ranks, three_kv)
        assert "tensor_parallel_size 2" in msg and "num_key_value_heads 3" in msg
        assert error(ranks, tiny_config("LlamaForCausalLM", vocab=50, hidden=32, ffn=32)) == {""}
        spec = EngineConfig(model=CONFIG.model, speculative=SpeculativeConfig())
        (msg,) = set(pool.call(ranks, "runner_error", spec).values())
        assert msg.startswith("speculative_config:")
    with layout(pool, rendezvous, 1, 2) as ranks:
        one_layer = tiny_config("LlamaForCausalLM", vocab=50, hidden=32, ffn=32, layers=1)
        (msg,) = error(ranks, one_layer)
        assert "pipeline_parallel_size 2 exceeds num_hidden_layers 1" in msg


@pytest.mark.parametrize(
    ("tp", "kv_heads", "want"),
    [
        (1, 2, [range(0, 2)]),
        (2, 4, [range(0, 2), range(2, 4)]),
        (4, 4, [range(i, i + 1) for i in range(4)]),
        (2, 1, [range(0, 1), range(0, 1)]),  # replicated
        (4, 2, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
        (8, 2, [range(0, 1)] * 4 + [range(1, 2)] * 4),
    ],
)
def test_kv_head_range(tp, kv_heads, want) -> None:
    assert [distributed.kv_head_range(r, tp, kv_heads) for r in range(tp)] == want


@pytest.mark.parametrize(("tp", "kv_heads"), [(2, 3), (4, 6), (3, 2)])
def test_kv_head_range_rejects_uneven_splits(tp, kv_heads) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        distributed.kv_head_range(0, tp, kv_heads)


@pytest.mark.parametrize(
    ("pp", "layers", "sizes"),
    [(1, 5, [5]), (2, 4, [2, 2]), (2, 3, [2, 1]), (3, 8, [3, 3, 2]), (4, 7, [2, 2, 2, 1]),
     (3, 3, [1, 1, 1])],
)
def test_pp_layer_range_is_contiguous_and_even(pp, layers, sizes) -> None:
    parts = [distributed.pp_layer_range(r, pp, layers) for r in range(pp)]
    assert [len(p) for p in parts] == sizes
    assert [i for p in parts for i in p] == list(range(layers))


def test_pp_layer_range_and_driver_rank_errors() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds num_hidden_layers 2"):
        distributed.pp_layer_range(0, 3, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        distributed.driver_rank(2, 0)
    assert [distributed.driver_rank(t, p) for t, p in LAYOUTS] == [0, 1, 2]


@pytest.mark.parametrize(
    ("sizes", "tp", "pp", "match"),
    [
        ({"heads": 6, "kv_heads": 2}, 4, 1, "tensor_parallel_size 4 must divide num_attention_heads 6"),
        ({"heads": 4, "kv_heads": 4, "ffn": 30}, 4, 1, "tensor_parallel_size 4 must divide intermediate_size 30"),
        ({"heads": 6, "kv_heads": 3}, 2, 1, "tensor_parallel_size 2 must divide num_key_value_heads 3"),
        ({"heads": 4, "kv_heads": 2, "layers": 2}, 1, 3, "pipeline_parallel_size 3 exceeds"),
    ],
)  # fmt: skip
def test_model_shard_rejects_bad_layouts(sizes, tp, pp, match) -> None:
    config = tiny_config("LlamaForCausalLM", vocab=50, hidden=24, **{"ffn": 32, **sizes})
    with pytest.raises(ValueError, match=match):
        ModelShard.of(config, 0, tp, 0, pp)


def test_model_shard_cuts_hf_tensors() -> None:
    """Rank 1 of TP=2 on a 5-token vocabulary, 4 heads of 2, 1 KV head, MLP 6."""
    config = tiny_config("LlamaForCausalLM", vocab=5, hidden=8, ffn=6, heads=4, kv_heads=1)
    shard = ModelShard.of(config, 1, 2, 0, 1)
    w = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)
    embed = shard.shard_hf_tensor("embed_tokens", "weight", w)
    assert torch.equal(embed, torch.cat([w[3:], torch.zeros(1, 8)]))  # ids 3, 4 and padding
    q = torch.arange(8 * 8, dtype=torch.float32).view(8, 8)
    assert torch.equal(shard.shard_hf_tensor("q_proj", "weight", q), q[4:])
    k = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    assert torch.equal(shard.shard_hf_tensor("k_proj", "weight", k), k)  # the one head
    up = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    assert torch.equal(shard.shard_hf_tensor("up_proj", "weight", up), up[3:])
    down = up.T.contiguous()
    assert torch.equal(shard.shard_hf_tensor("down_proj", "weight", down), down[:, 3:])
    assert torch.equal(shard.shard_hf_tensor("o_proj", "bias", torch.ones(8)), torch.zeros(8))
    rank0 = ModelShard.of(config, 0, 2, 0, 1)
    assert torch.equal(rank0.shard_hf_tensor("o_proj", "bias", torch.ones(8)), torch.ones(8))


def test_single_process_is_a_world_of_one() -> None:
    """Without ``init_distributed`` the groups are one rank whose collectives return
    their input, and the model is whole."""
    assert not distributed.is_initialized()
    tp, pp = distributed.get_tp_group(), distributed.get_pp_group()
    assert (tp.world_size, tp.rank_in_group, pp.world_size) == (1, 0, 1)
    assert tp.is_first_rank and tp.is_last_rank
    t = torch.randn(3, 4)
    assert tp.all_reduce(t) is t and tp.gather(t) is t
    with pytest.raises(RuntimeError, match="no next stage"):
        pp.send({"hidden": t})
    with pytest.raises(RuntimeError, match="no previous stage"):
        pp.recv({"hidden": (3, 4)}, torch.float32, "cpu")
    config = tiny_config("LlamaForCausalLM", vocab=50, hidden=24, ffn=32, layers=3)
    shard = ModelShard.current(config)
    assert (shard.layers, shard.kv_heads, shard.vocab_per_rank) == (range(3), range(2), 50)
    distributed.destroy_distributed()  # a no-op, twice
    distributed.destroy_distributed()
