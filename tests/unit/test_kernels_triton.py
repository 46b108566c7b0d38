"""Triton kernels against the torch references, on the CPU via Triton's interpreter,
or natively on a GPU with ``TANDEM_TEST_DEVICE=cuda`` (``make gpu-check``).

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported (its own
library functions are decorated at import). When another test module of this
pytest process imported it first (transformers may), this module re-runs itself
in a fresh interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys

NATIVE = os.environ.get("TANDEM_TEST_DEVICE") == "cuda"
_TRITON_PREIMPORTED = (
    not NATIVE and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if not NATIVE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if NATIVE and not torch.cuda.is_available():  # pragma: no cover - GPU machines only
    pytest.skip("TANDEM_TEST_DEVICE=cuda without a CUDA GPU", allow_module_level=True)
if not NATIVE and os.environ.get("TRITON_INTERPRET") != "1":  # pragma: no cover - opt-out
    pytest.skip("TRITON_INTERPRET is not 1", allow_module_level=True)

DEVICE = "cuda" if NATIVE else "cpu"
in_process = pytest.mark.skipif(
    _TRITON_PREIMPORTED, reason="triton imported without the interpreter: see the rerun"
)


@pytest.fixture(autouse=True)
def _on_device():
    """Natively, tensors made without a device go to the GPU (the helpers below that
    default to the CPU are given ``DEVICE`` explicitly)."""
    if not NATIVE:
        yield
        return
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(None)


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="running in this process")
def test_rerun_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


from tandem.kernels.attention import (  # noqa: E402
    build_attention_metadata,
    paged_attention_ref,
    paged_attention_triton,
)
from tandem.kernels.cache import (  # noqa: E402
    allocate_kv_cache,
    reshape_and_cache_ref,
    reshape_and_cache_triton,
)
from tandem.kernels.layernorm import rms_norm_ref, rms_norm_triton  # noqa: E402


# NOTE: float16, not bfloat16, under the interpreter: it computes through numpy, which
# has no bfloat16 (bf16 kernels give NaN there); natively on a GPU bf16 runs too.
@in_process
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, *([torch.bfloat16] if NATIVE else [])]
)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_triton_matches_ref(dtype, hidden):
    torch.manual_seed(0)
    x = (torch.randn(5, hidden) * 3).to(dtype)
    w = torch.randn(hidden).to(dtype)
    atol = {torch.float32: 1e-5, torch.float16: 4e-3}.get(dtype, 3e-2)
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=atol, rtol=0
    )


@in_process
def test_reshape_and_cache_triton_matches_ref():
    torch.manual_seed(0)
    bs, kvh, hd = 4, 2, 8
    ref = allocate_kv_cache(6, 3, bs, kvh, hd, torch.float32, DEVICE)
    tri = ref.clone()
    slots = torch.tensor([5 * bs + 3, 0, 2 * bs + 1, 7])
    # value as a strided view of a fused projection, as the model passes it
    fused = torch.randn(4, 3 * kvh * hd)
    key = fused[:, : kvh * hd].view(4, kvh, hd)
    value = fused[:, 2 * kvh * hd :].view(4, kvh, hd)
    reshape_and_cache_ref(key, value, ref[:, 1, 0], ref[:, 1, 1], slots // bs, slots % bs)
    reshape_and_cache_triton(key, value, tri[:, 1, 0], tri[:, 1, 1], slots)
    torch.testing.assert_close(tri, ref, rtol=0, atol=0)


@in_process
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_triton_matches_ref(num_heads, num_kv_heads, window):
    torch.manual_seed(1)
    bs, hd, num_blocks = 4, 16, 48
    # decodes (incl. a 1-token prompt), a fresh prompt and a prefix-cached chunk
    seqs = [(9, 1), (16, 1), (0, 1), (22, 1), (0, 7), (5, 6)]
    kv = allocate_kv_cache(num_blocks, 1, bs, num_kv_heads, hd, torch.float32, DEVICE)
    kv.normal_()  # stale data in unused slots must not leak into results
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    meta = build_attention_metadata([n for _, n in seqs], [c for c, _ in seqs], tables, bs,
                                    DEVICE)
    query = torch.randn(meta.num_tokens, num_heads, hd)
    key = torch.randn(meta.num_tokens, num_kv_heads, hd)
    value = torch.randn(meta.num_tokens, num_kv_heads, hd)
    reshape_and_cache_ref(key, value, *layer, meta.block_idx, meta.block_offset)
    ref = paged_attention_ref(query, key, value, *layer, meta, hd**-0.5, window)
    tri = paged_attention_triton(query, key, value, *layer, meta, hd**-0.5, window)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.skipif(NATIVE, reason="CPU model through the interpreter; make gpu-check's "
                    "greedy check runs the model on the GPU")
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "MistralForCausalLM"])
def test_model_on_triton_path_matches_transformers(arch, monkeypatch):
    """The wrappers' Triton branches wired end to end (what CUDA tensors take):
    q/k norm on strided views, K/V writes from the fused projection, decode
    attention from the blocks, sliding window; logits equal transformers'."""
    from tiny_models import tiny_config, tiny_hf_model

    from tandem.engine.models.registry import build_model
    from tandem.kernels import backend

    class TritonEverywhere(backend.KernelBackends):
        def for_tensor(self, t: torch.Tensor) -> backend.KernelBackend:
            return backend.KernelBackend.TRITON

    base = backend.current()
    monkeypatch.setattr(backend, "_current", TritonEverywhere(base.config, base.platform))
    window = 5 if arch.startswith("Mistral") else None
    config = tiny_config(arch, vocab=64, hidden=32, ffn=48, head_dim=16, max_len=64,
                         sliding_window=window)
    hf = tiny_hf_model(config, std=0.2, norms=(0.5, 1.5))
    model = build_model(config, hf.state_dict(), torch.float32, "cpu", 64)
    token_ids = list(range(3, 15))
    with torch.no_grad():
        ref = hf(torch.tensor([token_ids])).logits[0]
    kv = allocate_kv_cache(8, 2, 4, 2, 16, torch.float32)
    views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(2)]
    logits, done = [], 0
    with torch.inference_mode():
        for n in (7, 1, 1, 3):  # a prompt chunk, two decodes, a prefix-cached chunk
            meta = build_attention_metadata([n], [done], [[7, 2, 5, 0]], 4)
            ids = torch.tensor(token_ids[done : done + n])
            logits.append(model.compute_logits(model(ids, meta.positions, views, meta)))
            done += n
    torch.testing.assert_close(torch.cat(logits), ref, rtol=0, atol=1e-4)


@in_process
def test_padded_decode_batch_writes_no_padding_slot_and_matches_unpadded():
    """A decode batch padded to a CUDA-graph size (engine/cuda_graphs.py), on the kernels
    a graph replays: the padding rows (PAD_SLOT_ID) leave the cache as it was, the real
    rows' attention equals the unpadded batch's, the padding rows' stays finite."""
    from tandem.engine.cuda_graphs import DecodeInputs
    from tandem.kernels.attention_backend import AttentionBackend

    torch.manual_seed(2)
    bs, kvh, heads, hd = 4, 2, 4, 16
    kv = allocate_kv_cache(12, 1, bs, kvh, hd, torch.float32, DEVICE)
    kv.normal_()
    layer = (kv[:, 0, 0], kv[:, 0, 1])
    computed, tables = [3, 9], [[5], [2, 8, 11]]
    inputs = DecodeInputs(max_num_seqs=8, max_blocks_per_seq=4, block_size=bs, device=DEVICE)
    inputs.fill([0, 0], computed, tables, padded_size=4)
    inputs.upload(4)
    meta = inputs.metadata(4, AttentionBackend.TRITON_PAGED)
    query = torch.randn(4, heads, hd)
    key = torch.randn(4, kvh, hd)
    value = torch.randn(4, kvh, hd)
    expected = kv.clone()
    reshape_and_cache_ref(key[:2], value[:2], expected[:, 0, 0], expected[:, 0, 1],
                          meta.block_idx[:2], meta.block_offset[:2])
    reshape_and_cache_triton(key, value, *layer, meta.slot_mapping)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0)
    out = paged_attention_triton(query, key, value, *layer, meta, hd**-0.5)
    unpadded = build_attention_metadata([1, 1], computed, tables, bs, DEVICE)
    ref = paged_attention_ref(query[:2], key[:2], value[:2], *layer, unpadded, hd**-0.5)
    torch.testing.assert_close(out[:2], ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out[2:]).all()


class _EagerGraph:
    """Stands in for a captured ``torch.cuda.CUDAGraph`` on the CPU: each replay runs
    the model over the runner's static buffers, the work a capture records."""

    def __init__(self, runner, size: int, kv_caches) -> None:
        from tandem.kernels.attention_backend import AttentionBackend

        self.runner, self.size, self.kv_caches = runner, size, kv_caches
        self.meta = runner.inputs.metadata(size, AttentionBackend.TRITON_PAGED)

    def replay(self) -> None:
        r = self.runner
        ids = r.inputs.input_ids(self.size)
        r.outputs[self.size] = r.model(ids, self.meta.positions, self.kv_caches, self.meta)


@in_process
@pytest.mark.skipif(NATIVE, reason="CPU stand-in for the graphs; on a GPU make gpu-check "
                    "runs the real ones")
def test_runner_replaying_padded_decode_steps_matches_eager(monkeypatch):
    """The model runner's graph branch (engine/cuda_graphs.py) with a CPU stand-in for
    the captured graphs, on the Triton kernels a graph replays: decode steps of 3, 2 and
    1 requests (after an eager prefill step) padded to sizes 4, 2 and 1 give the eager runner's tokens, and the
    padding rows leave every KV block the eager run did not write untouched."""
    from tiny_models import as_loaded_model, tiny_config, tiny_hf_model

    from tandem.engine.config import CacheConfig, EngineConfig, ModelConfig
    from tandem.engine.cuda_graphs import CudaGraphRunner
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.request import Request
    from tandem.engine.sampling_params import SamplingParams
    from tandem.engine.sched_output import SchedulerOutput
    from tandem.kernels import backend

    class TritonEverywhere(backend.KernelBackends):
        def for_tensor(self, t: torch.Tensor) -> backend.KernelBackend:
            return backend.KernelBackend.TRITON

    base = backend.current()
    monkeypatch.setattr(backend, "_current", TritonEverywhere(base.config, base.platform))
    hf = tiny_hf_model(tiny_config("LlamaForCausalLM", vocab=64, hidden=32, ffn=48, layers=1,
                                   head_dim=16, max_len=64, special_tokens=False), std=0.2)
    loaded = as_loaded_model(hf, "tiny", 64)
    config = EngineConfig(model=ModelConfig(dtype="float32", max_model_len=64),
                          cache=CacheConfig(block_size=4, num_blocks_override=24))

    def run(with_graphs: bool):
        runner = ModelRunner(config, loaded)
        runner.initialize_kv_cache(24)
        torch.manual_seed(0)
        runner.kv_cache.normal_()  # the same stale bytes in both runs: a stray write shows
        before = runner.kv_cache.clone()
        if with_graphs:
            graphs = CudaGraphRunner(runner.model, (1, 2, 4), 16, 4, torch.device("cpu"))
            graphs.graphs = {s: _EagerGraph(graphs, s, runner.kv_caches) for s in (1, 2, 4)}
            runner.cuda_graphs = graphs
        reqs = [Request(f"r{i}", list(range(3 + i, 9 + 2 * i)),
                        SamplingParams(temperature=0.0, max_tokens=2 + i)) for i in range(3)]
        tables = {r.request_id: [23 - 6 * i - j for j in range(5)] for i, r in enumerate(reqs)}
        while running := [r for r in reqs if r.num_output_tokens < r.sampling_params.max_tokens]:
            sched = SchedulerOutput()
            for r in running:
                n = r.num_tokens - r.num_computed_tokens
                sched.scheduled_requests.append(r)
                sched.num_scheduled_tokens[r.request_id] = n
                sched.block_tables[r.request_id] = tables[r.request_id]
                sched.total_num_scheduled_tokens += n
            out = runner.execute_model(sched)
            for r in running:
                r.num_computed_tokens += sched.num_scheduled_tokens[r.request_id]
                r.append_output_token(out.sampled_token_ids[r.request_id])
        replays = runner.cuda_graphs.num_replays if with_graphs else {}
        return [r.output_token_ids for r in reqs], runner.kv_cache, before, replays

    eager_tokens, eager_kv, before, _ = run(False)
    graph_tokens, graph_kv, _, replays = run(True)
    assert graph_tokens == eager_tokens
    assert replays == {4: 1, 2: 1, 1: 1}
    written = (eager_kv != before).any(dim=(1, 2, 3, 4, 5))  # the blocks the requests used
    torch.testing.assert_close(graph_kv[~written], before[~written], rtol=0, atol=0)
    torch.testing.assert_close(graph_kv[written], eager_kv[written], rtol=1e-5, atol=1e-5)
