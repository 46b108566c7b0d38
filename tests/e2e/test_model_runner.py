"""ModelRunner driven by hand-built SchedulerOutputs, against transformers generate.

A tiny random Llama: a prompt prefilled in chunks, then decoded greedily, mixed into
batches with other requests, equals ``generate(do_sample=False)``. The real default
model (float32) on two prompts batched together equals transformers token for token.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import transformers
from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tandem.engine.executor import create_executor
from tandem.engine.executor.uniproc import UniProcExecutor
from tandem.engine.model_facts import ModelFacts
from tandem.engine.model_files import default_model_path, load_tokenizer
from tandem.engine.model_loader import LoadedModel, gguf_cache_path, load_model
from tandem.engine.model_runner import ModelRunner
from tandem.engine.models.registry import build_model
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sched_output import SchedulerOutput
from tandem.engine.worker import Worker

BLOCK_SIZE = 4


def tiny_loaded(arch: str = "LlamaForCausalLM") -> tuple[LoadedModel, transformers.PreTrainedModel]:
    config = tiny_config(arch, vocab=101, hidden=48, ffn=96, special_tokens=False)
    hf = tiny_hf_model(config, std=0.2)
    return as_loaded_model(hf, "tiny", 128), hf


def make_runner(loaded: LoadedModel, num_blocks: int = 64, max_model_len: int = 128):
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=num_blocks),
    )
    runner = ModelRunner(config, loaded)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


class HandScheduler:
    """Minimal stand-in for the scheduler: fixed block tables, explicit chunks."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # hand out high ids first
        self.tables: dict[str, list[int]] = {}

    def output(self, work: list[tuple[Request, int]]) -> SchedulerOutput:
        out = SchedulerOutput()
        for req, n in work:
            table = self.tables.setdefault(req.request_id, [])
            need = -(-(req.num_computed_tokens + n) // self.block_size)
            while len(table) < need:
                table.append(self.free.pop())
            out.scheduled_requests.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            out.block_tables[req.request_id] = list(table)
            out.total_num_scheduled_tokens += n
        return out

    @staticmethod
    def update(sched: SchedulerOutput, result) -> None:
        for req in sched.scheduled_requests:
            req.num_computed_tokens += sched.num_scheduled_tokens[req.request_id]
            if req.request_id in result.sampled_token_ids:
                req.append_output_token(result.sampled_token_ids[req.request_id])


def greedy(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt) :].tolist()


def assert_same_greedy(ours: list[int], theirs: list[int], eos: int | None) -> None:
    """transformers stops at EOS; we keep going (the scheduler would stop us)."""
    assert theirs, "transformers generated nothing"
    if len(theirs) < len(ours):
        assert theirs[-1] == eos
    assert ours[: len(theirs)] == theirs


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded()


def test_runner_reports_layout(tiny):
    loaded, _ = tiny
    runner = make_runner(loaded, num_blocks=10)
    assert runner.kv_cache.shape == (10, 2, 2, BLOCK_SIZE, 2, 12)
    assert (runner.vocab_size, runner.num_layers, runner.num_kv_heads, runner.head_dim) == (
        101,
        2,
        2,
        12,
    )
    assert runner.max_model_len == 128 and runner.dtype == torch.float32


def test_chunked_prefill_then_greedy_decode_matches_hf(tiny):
    loaded, hf = tiny
    runner = make_runner(loaded)
    hand = HandScheduler(64)
    prompt = torch.randint(0, 101, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    req = greedy("r0", prompt, 12)
    for chunk in (8, 5, 8):
        sched = hand.output([(req, chunk)])
        result = runner.execute_model(sched)
        # Only the last chunk samples.
        assert bool(result.sampled_token_ids) == (req.num_computed_tokens + chunk == len(prompt))
        hand.update(sched, result)
    while req.num_output_tokens < 12:
        sched = hand.output([(req, 1)])
        hand.update(sched, runner.execute_model(sched))
    assert req.output_token_ids == hf_greedy(hf, prompt, 12)
    assert len(req.output_token_ids) == 12


def test_mixed_batches_match_hf_per_request(tiny):
    """Decodes and prefill chunks of other requests share steps; each request's
    greedy tokens still equal its own transformers generate."""
    loaded, hf = tiny
    runner = make_runner(loaded)
    hand = HandScheduler(64)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (1, 9, 30, 5)]
    reqs = [greedy(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    budget = 11  # small token budget: forces chunking and mixing
    while any(r.num_output_tokens < 10 for r in reqs):
        work, left = [], budget
        # Decodes first, then prefill chunks (as the scheduler orders them).
        for r in reqs:
            if r.num_computed_tokens >= r.num_prompt_tokens and r.num_output_tokens < 10:
                work.append((r, 1))
                left -= 1
        for r in reqs:
            remaining = r.num_prompt_tokens - r.num_computed_tokens
            if remaining > 0 and left > 0:
                work.append((r, min(remaining, left)))
                left -= work[-1][1]
        sched = hand.output(work)
        hand.update(sched, runner.execute_model(sched))
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == hf_greedy(hf, p, 10), r.request_id


def test_uni_executor_equals_model_runner(tiny):
    """The uni executor (one in-process Worker) returns the model runner's outputs step
    for step, on the same mixed chunked batches: greedy tokens, seeded samples and
    logprobs alike; its facts and KV cache size are the runner's."""
    loaded, _ = tiny
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=64),
    )
    runner = ModelRunner(config, loaded)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    executor = create_executor(config, loaded)
    assert isinstance(executor, UniProcExecutor)
    assert executor.determine_num_blocks() == 64
    executor.initialize_kv_cache(64)
    facts = executor.model_facts
    assert facts == ModelFacts(
        model_id="tiny", vocab_size=runner.vocab_size, max_model_len=runner.max_model_len,
        eos_token_id=None, num_layers=runner.num_layers, num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim, dtype="float32", device="cpu",
        architecture="LlamaForCausalLM", model_impl="tandem",
        weight_bytes=sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
    )

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (14, 1, 6)]
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=6, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=6),
    ]

    def batch() -> list[Request]:
        # The same ids in both batches, so their outputs (keyed by id) compare equal.
        pairs = enumerate(zip(prompts, kinds, strict=True))
        return [Request(f"x{i}", p, sp) for i, (p, sp) in pairs]

    ours, theirs = batch(), batch()
    hand_ours, hand_theirs = HandScheduler(64), HandScheduler(64)
    plan = [[(0, 9), (1, 1), (2, 6)], [(1, 1), (2, 1), (0, 5)]] + [[(0, 1), (1, 1), (2, 1)]] * 5
    for work in plan:
        sched_a = hand_ours.output([(ours[i], n) for i, n in work])
        sched_b = hand_theirs.output([(theirs[i], n) for i, n in work])
        out_a, out_b = executor.execute_model(sched_a), runner.execute_model(sched_b)
        assert out_a.sampled_token_ids == out_b.sampled_token_ids
        assert out_a.logprobs == out_b.logprobs
        hand_ours.update(sched_a, out_a)
        hand_theirs.update(sched_b, out_b)
    assert [r.output_token_ids for r in ours] == [r.output_token_ids for r in theirs]
    assert [r.num_output_tokens for r in ours] == [6, 7, 7]

    class Recorder:
        def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
            self.kv_cache = kv_cache

    rec = Recorder()
    executor.register_kv_caches(rec)  # type: ignore[arg-type]
    assert rec.kv_cache is executor.driver_worker.kv_cache
    assert rec.kv_cache.shape == runner.kv_cache.shape
    executor.shutdown()
    with pytest.raises(RuntimeError, match="load_model"):
        executor.execute_model(sched_a)
    executor.shutdown()  # idempotent


def test_worker_lifecycle_errors(tiny):
    loaded, _ = tiny
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=8),
    )
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\)"):
        Worker(config, rank=1)
    worker = Worker(config, loaded=loaded)
    with pytest.raises(RuntimeError, match="load_model"):
        worker.model_facts()
    worker.load_model()
    with pytest.raises(RuntimeError, match="twice"):
        worker.load_model()
    with pytest.raises(RuntimeError, match="initialize_kv_cache"):
        _ = worker.kv_cache
    worker.initialize_kv_cache(worker.determine_num_blocks())
    assert worker.kv_cache.shape[0] == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runner_matches_hf(tiny):
    """The CUDA path (Triton kernels where installed, SDPA prefills) on a mixed
    chunked batch: greedy tokens equal transformers' on the CPU."""
    loaded, hf = tiny
    model = build_model(loaded.hf_config, hf.state_dict(), torch.float32, "cuda", 128)
    cuda_loaded = dataclasses.replace(loaded, model=model, device=torch.device("cuda"))
    config = EngineConfig(
        model=ModelConfig(dtype="float32", device="cuda", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks_override=64),
    )
    runner = ModelRunner(config, cuda_loaded)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    assert runner.kv_cache.is_cuda
    hand = HandScheduler(64)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (13, 1, 6)]
    reqs = [greedy(f"c{i}", p, 8) for i, p in enumerate(prompts)]
    sched = hand.output([(reqs[0], 9), (reqs[1], 1), (reqs[2], 6)])
    hand.update(sched, runner.execute_model(sched))
    sched = hand.output([(reqs[1], 1), (reqs[2], 1), (reqs[0], 4)])
    hand.update(sched, runner.execute_model(sched))
    while any(r.num_output_tokens < 8 for r in reqs):
        sched = hand.output([(r, 1) for r in reqs if r.num_output_tokens < 8])
        hand.update(sched, runner.execute_model(sched))
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_token_ids == hf_greedy(hf, p, 8), r.request_id


def test_determine_num_blocks_from_memory_budget(tiny):
    loaded, _ = tiny
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=10_000),
    )
    runner = ModelRunner(config, loaded)
    # 2 layers * K,V * 4 tokens * 2 heads * 12 dims * 4 bytes = 1536 bytes per block
    assert runner.block_bytes == 1536
    assert runner.determine_num_blocks() == 10_000 // 1536


def test_determine_num_blocks_profiles_when_no_budget(tiny):
    loaded, _ = tiny
    config = EngineConfig(
        model=ModelConfig(dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=3),
    )
    runner = ModelRunner(config, loaded)
    # Capped at max_num_seqs full-length sequences: 3 * 64 / 4 blocks.
    assert runner.determine_num_blocks() == 48
    assert 0 < runner.activation_bytes_estimate() < 10 << 20


def test_max_model_len_beyond_model_rejected(tiny):
    loaded, _ = tiny
    with pytest.raises(ValueError, match="max_model_len"):
        ModelRunner(EngineConfig(model=ModelConfig(max_model_len=4096)), loaded)


def test_prefix_cached_blocks_are_attended(tiny):
    """A request whose first blocks were computed by another request (a prefix-cache
    hit: shared block ids, num_computed_tokens > 0 at its first step) equals HF."""
    loaded, hf = tiny
    runner = make_runner(loaded)
    hand = HandScheduler(64)
    gen = torch.Generator().manual_seed(11)
    shared = torch.randint(0, 101, (8,), generator=gen).tolist()  # 2 full blocks
    first = greedy("a", shared + torch.randint(0, 101, (5,), generator=gen).tolist(), 3)
    sched = hand.output([(first, first.num_prompt_tokens)])
    hand.update(sched, runner.execute_model(sched))
    second = greedy("b", shared + torch.randint(0, 101, (6,), generator=gen).tolist(), 6)
    hand.tables["b"] = hand.tables["a"][:2]  # reuse the cached prefix blocks
    second.num_computed_tokens = 8
    sched = hand.output([(first, 1), (second, 6)])
    hand.update(sched, runner.execute_model(sched))
    while second.num_output_tokens < 6:
        sched = hand.output([(second, 1)])
        hand.update(sched, runner.execute_model(sched))
    assert second.output_token_ids == hf_greedy(hf, second.prompt_token_ids, 6)
    assert first.output_token_ids == hf_greedy(hf, first.prompt_token_ids, 2)


def test_shorter_loaded_rotary_table_is_extended(tiny):
    loaded, hf = tiny
    small = build_model(loaded.hf_config, hf.state_dict(), torch.float32, "cpu", 16)
    loaded_small = dataclasses.replace(loaded, model=small, max_position=16)
    runner = make_runner(loaded_small, max_model_len=64)
    assert small.rotary.max_position == 64
    hand = HandScheduler(64)
    prompt = list(range(40))
    req = greedy("long", prompt, 2)
    sched = hand.output([(req, 40)])
    hand.update(sched, runner.execute_model(sched))
    sched = hand.output([(req, 1)])
    hand.update(sched, runner.execute_model(sched))
    assert req.output_token_ids == hf_greedy(hf, prompt, 2)


@pytest.fixture(scope="module")
def real():
    """Our loader's default model and transformers' own load of the same GGUF."""
    from hf_oracle import hf_default_model

    loaded = load_model(ModelConfig(dtype="float32", max_model_len=512))
    return loaded, hf_default_model()


@pytest.mark.slow
class TestDefaultModel:
    """The real default model (SmolLM2-135M-Instruct GGUF) in float32."""

    def test_two_prompts_batched_match_hf(self, real):
        loaded, hf = real
        tok = loaded.tokenizer
        assert loaded.eos_token_id == tok.eos_token_id
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts = [
            tok.encode(chat),
            tok.encode("The three primary colors are"),
        ]
        config = EngineConfig(
            model=ModelConfig(dtype="float32", max_model_len=512),
            cache=CacheConfig(num_blocks_override=32),
        )
        runner = ModelRunner(config, loaded)
        runner.initialize_kv_cache(runner.determine_num_blocks())
        hand = HandScheduler(32, block_size=16)
        reqs = [greedy(f"p{i}", p, 16) for i, p in enumerate(prompts)]
        sched = hand.output([(r, r.num_prompt_tokens) for r in reqs])
        hand.update(sched, runner.execute_model(sched))
        while reqs[0].num_output_tokens < 16:
            sched = hand.output([(r, 1) for r in reqs])
            hand.update(sched, runner.execute_model(sched))
        for r, p in zip(reqs, prompts, strict=True):
            theirs = hf_greedy(hf, p, 16)
            assert_same_greedy(r.output_token_ids, theirs, loaded.eos_token_id)


@pytest.mark.slow
def test_default_model_loader_facts(real):
    """The default GGUF loads into our Llama, with its tokenizer and EOS, and leaves a
    complete dequantized cache folder behind for the next load."""
    loaded, hf = real
    assert loaded.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.model.lm_head is None  # tied embeddings
    assert loaded.dtype == torch.float32 and loaded.max_position == 512
    assert loaded.eos_token_id == hf.generation_config.eos_token_id == 2
    cache = gguf_cache_path(default_model_path())
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(cache, name)), name
    tok = load_tokenizer(None)
    assert tok.encode("Hello world") == loaded.tokenizer.encode("Hello world")
