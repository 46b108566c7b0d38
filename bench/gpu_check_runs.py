"""The GPU check's engine checks (bench/gpu_check.py runs each in a process of its own).

Each ``check_*`` takes a ``Context`` and returns its part of the report, with ``passed``
decided by bench/gpu_check_rules.py (the greedy near-tie rule is described there).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.gpu_check_models import ensure_model
from tandem.bench.gpu_check_rules import (
    TIE_FLOOR,
    TIE_NOISE_FACTOR,
    agreement,
    divergences,
    got_its_share,
    greedy_passed,
    within_budget,
)

NUM_PROMPTS = 24
#: the first output length; prompt k asks for MIN_NEW_TOKENS + k tokens, so the decode
#: batch shrinks by one request per step at the end and several captured sizes replay
MIN_NEW_TOKENS = 8
#: the later half of the prompts share this many tokens (prefix-cache hits: masked prefills)
SHARED_PREFIX = 96
#: sizes per device: the CPU ones make a dry run of the logic quick
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {"masked_context": 32768, "masked_chunk": 2048, "masked_budget_bytes": 8 << 30,
             "engine_model": "smollm2_shape", "engine_max_len": 8192, "engines_util": 0.4,
             "decode_batches": (1, 32, 128), "decode_steps": 32, "greedy_prompts": NUM_PROMPTS},
    "cpu": {"masked_context": 1024, "masked_chunk": 256, "masked_budget_bytes": 1 << 30,
            "engine_model": "greedy", "engine_max_len": 1024, "engines_util": 0.1,
            "decode_batches": (1, 4, 8), "decode_steps": 4, "greedy_prompts": 8},
}


@dataclass(frozen=True)
class Context:
    """Where a check runs: ``device`` ("cuda", or "cpu" for a dry run), ``out_dir`` (the
    report's folder: logs, models under ``out_dir/models``) and its time ``budget_s``."""

    device: str
    out_dir: Path
    budget_s: float
    #: where the result goes; ``save_partial`` writes what is done so far there
    result_path: Path | None = None

    def save_partial(self, result: dict[str, Any]) -> None:
        """Write ``result`` so far (``passed`` false, ``incomplete`` true): a check cut off
        at its budget still reports what it measured."""
        if self.result_path is not None:
            partial = {**result, "passed": False, "incomplete": True}
            self.result_path.write_text(json.dumps(partial, indent=2))

    @property
    def models(self) -> Path:
        """The folder of the random-weight models (built once, reused by later checks)."""
        return self.out_dir / "models"

    @property
    def sizes(self) -> dict[str, Any]:
        """``SIZES`` of this device."""
        return SIZES["cuda" if self.device.startswith("cuda") else "cpu"]


# -- greedy vs transformers --------------------------------------------------------------------


def greedy_prompts(vocab: int, n: int = NUM_PROMPTS, seed: int = 0) -> list[list[int]]:
    """``n`` seeded prompts of token ids: the first half of random lengths (3 to 299), the
    rest ``SHARED_PREFIX`` common tokens then 1, 8, 15, ... of their own."""
    import torch

    g = torch.Generator().manual_seed(seed)
    half = n // 2
    lens = torch.randint(3, 300, (half,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]
    shared = torch.randint(0, vocab, (SHARED_PREFIX,), generator=g).tolist()
    prompts += [shared + torch.randint(0, vocab, (1 + 7 * i,), generator=g).tolist()
                for i in range(n - half)]
    return prompts


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' ``n`` greedy tokens after ``prompt`` (the models have no EOS)."""
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def tandem_greedy(ctx: Context, folder: Path, dtype: str, prompts: list[list[int]],
                  lens: list[int], enforce_eager: bool) -> tuple[list[list[int]], dict[int, int]]:
    """tandem's greedy tokens and its CUDA graph replays per captured size. Prefills are
    chunked at 256 tokens (later chunks and prefix-cache hits take the masked path)."""
    from tandem import LLM, SamplingParams

    _release(ctx.device)
    with LLM(model=str(folder), device=ctx.device, dtype=dtype, max_model_len=1024,
             max_num_seqs=32, max_num_batched_tokens=256, enforce_eager=enforce_eager) as llm:
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lens]
        outs = llm.generate(prompts, params, use_tqdm=False)
        graphs = _runner(llm).cuda_graphs
        replays = dict(graphs.num_replays) if graphs is not None else {}
    return [list(o.outputs[0].token_ids) for o in outs], replays


def sampled_run(ctx: Context, folder: Path, prompts: list[list[int]], vocab: int,
                dtype: str = "float16", new_tokens: int = 16) -> dict[str, Any]:
    """Seeded temperature sampling in ``dtype`` (float16: its logits were once refused by
    the sampler), through both sampler paths (temperature only: the fused race; with
    top-k/top-p: the truncated one), twice in one engine; ``passed``: every request got
    ``new_tokens`` ids inside the vocabulary and the second pass drew what the first did."""
    from tandem import LLM, SamplingParams

    _release(ctx.device)
    params = [SamplingParams(temperature=0.8, max_tokens=new_tokens, seed=k,
                             **({"top_k": 50, "top_p": 0.9} if k % 2 else {}))
              for k in range(len(prompts))]
    with LLM(model=str(folder), device=ctx.device, dtype=dtype, max_model_len=1024,
             max_num_seqs=32, enforce_eager=True) as llm:
        runs = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
                for _ in range(2)]
    shaped = all(len(t) == new_tokens and all(0 <= i < vocab for i in t) for t in runs[0])
    return {"dtype": dtype, "num_prompts": len(prompts), "new_tokens": new_tokens,
            "repeatable": runs[0] == runs[1], "passed": shaped and runs[0] == runs[1]}


def _runner(llm: Any) -> Any:
    return llm.llm_engine.engine_core.executor.driver_worker.model_runner


def check_greedy(ctx: Context) -> dict[str, Any]:
    """tandem vs transformers greedy in float32 and bfloat16, each with CUDA graphs
    (``<dtype>``) and with ``enforce_eager`` (``<dtype>_eager``), and float32 graphs vs
    eager directly; divergences judged by ``is_near_tie``. Then seeded float16 sampling
    (``float16_sampled``, ``sampled_run``)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = ensure_model("greedy", ctx.models)
    judge = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    judge = judge.eval().to(ctx.device)
    prompts = greedy_prompts(judge.config.vocab_size, ctx.sizes["greedy_prompts"])
    lens = [MIN_NEW_TOKENS + i for i in range(len(prompts))]
    result: dict[str, Any] = {"prompt_lens": [len(p) for p in prompts], "output_lens": lens,
                              "tie_floor": TIE_FLOOR, "tie_noise_factor": TIE_NOISE_FACTOR}
    fp32: dict[bool, list[list[int]]] = {}
    for dtype in ("float32", "bfloat16"):
        hf = judge
        if dtype != "float32":
            hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))
            hf = hf.eval().to(ctx.device)
        ref = [hf_greedy(hf, p, n) for p, n in zip(prompts, lens, strict=True)]
        for eager in (False, True):
            got, replays = tandem_greedy(ctx, folder, dtype, prompts, lens, enforce_eager=eager)
            entry = agreement(got, ref)
            entry["graph_replays_by_size"] = replays
            entry["divergences"] = divergences(judge, hf, prompts, ref, got, dtype)
            need_replays = ctx.device.startswith("cuda") and not eager
            entry["passed"] = greedy_passed(entry, dtype, need_replays)
            result[f"{dtype}_eager" if eager else dtype] = entry
            ctx.save_partial(result)
            if dtype == "float32":
                fp32[eager] = got
    vs = agreement(fp32[False], fp32[True])
    vs["divergences"] = divergences(judge, judge, prompts, fp32[True], fp32[False], "float32")
    vs["passed"] = greedy_passed(vs, "float32", need_replays=False)
    result["float32_graphs_vs_eager"] = vs
    result["float16_sampled"] = sampled_run(ctx, folder, prompts[:8], judge.config.vocab_size)
    result["passed"] = all(v["passed"] for v in result.values() if isinstance(v, dict)
                           and "passed" in v)
    return result


# -- memory ----------------------------------------------------------------------------------


def _release(device: str) -> None:
    """Free what earlier engines of this process left (cycles, the allocator's cache):
    the next engine's free-memory check and profile must not see them."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _reset_peak(device: str) -> None:
    import torch

    _release(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.startswith("cuda") else None


def _total_memory(device: str) -> int | None:
    import torch

    return int(torch.cuda.mem_get_info(device)[1]) if device.startswith("cuda") else None


def check_masked_gqa(ctx: Context) -> dict[str, Any]:
    """A long prompt (32k tokens, GQA 16/2) prefilled in 2,048-token chunks (each later
    chunk masked), then a second prompt that hits its prefix in the cache (a masked
    prefill; the hit is required), in float32 and bfloat16, each engine given
    ``masked_budget_bytes`` through ``gpu_memory_utilization``; passes when the process's
    peak allocation stays within that budget (``within_budget``): prefills must not
    allocate what the memory profile did not reserve."""
    import torch

    s = ctx.sizes
    folder = ensure_model("long_gqa", ctx.models)
    total = _total_memory(ctx.device)
    budget = s["masked_budget_bytes"]
    util = budget / total if total else 0.5
    n = s["masked_context"]
    g = torch.Generator().manual_seed(3)
    first = torch.randint(0, 1024, (n,), generator=g).tolist()
    second = first[: n - 100] + torch.randint(0, 1024, (64,), generator=g).tolist()
    result: dict[str, Any] = {"context_tokens": n, "chunk_tokens": s["masked_chunk"],
                              "budget_bytes": budget, "gpu_memory_utilization": util,
                              "total_bytes": total}
    for dtype in ("float32", "bfloat16"):
        result[dtype] = _masked_run(ctx, folder, dtype, util, budget, [first, second])
        ctx.save_partial(result)
    result["passed"] = result["float32"]["passed"] and result["bfloat16"]["passed"]
    return result


def _masked_run(ctx: Context, folder: Path, dtype: str, util: float, budget: int,
                prompts: list[list[int]]) -> dict[str, Any]:
    """One engine of ``check_masked_gqa``: its prompts one after the other, its peak.
    NOTE: a function of its own, so that the engine and its cache are unreferenced once it
    returns: the next engine's peak and memory profile must not count them."""
    from tandem import LLM, SamplingParams

    _reset_peak(ctx.device)
    start = time.perf_counter()
    n = max(len(p) for p in prompts)
    with LLM(model=str(folder), device=ctx.device, dtype=dtype, max_model_len=n + 64,
             max_num_batched_tokens=ctx.sizes["masked_chunk"], max_num_seqs=256,
             enforce_eager=True, gpu_memory_utilization=util) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        runner = _runner(llm)
        kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
        peak = _peak(ctx.device)
    ran = all(len(o.outputs[0].token_ids) == 4 for o in outs)
    hit = outs[-1].num_cached_tokens
    entry = {"peak_allocated_bytes": peak, "kv_cache_bytes": kv_bytes,
             "prefix_cached_tokens": hit, "elapsed_s": time.perf_counter() - start,
             "passed": ran and hit > 0 and within_budget(peak, budget)}
    if peak is None:
        entry["memory_rule"] = f"not measured on {ctx.device}"
    return entry


def engine_worker(argv: list[str]) -> int:
    """One of the two engines of ``check_two_engines`` (a process of its own): with
    ``--after PEER``, waits before touching the GPU until that engine has built its engine
    and allocated its KV cache (its ``<dir>/<peer>.ready``), as ``tandem up`` starts
    engines sharing a GPU one after another: an engine's memory profile counts the
    device-wide rise in used memory since it started as its own. Then builds its engine,
    waits for the other's, generates, and stays up until the other has generated too;
    writes its JSON to ``<dir>/<name>.json``. Returns 0, or 1 if the peer never came."""
    import argparse

    p = argparse.ArgumentParser(prog="engine-worker")
    for flag in ("--model", "--device", "--name", "--peer", "--dir"):
        p.add_argument(flag, required=True)
    p.add_argument("--after", help="build the engine only once this engine is ready")
    p.add_argument("--util", type=float, required=True)
    p.add_argument("--max-len", type=int, required=True)
    p.add_argument("--wait-s", type=float, default=120.0)
    a = p.parse_args(argv)
    d = Path(a.dir)

    def arrived(name: str, stage: str) -> bool:
        deadline = time.monotonic() + a.wait_s
        while not (d / f"{name}.{stage}").exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def barrier(stage: str) -> bool:
        (d / f"{a.name}.{stage}").write_text("")
        return arrived(a.peer, stage)

    # NOTE: importing torch does not touch the GPU (no CUDA context): the imports overlap
    # the first engine's start, the engine (and _reset_peak, which creates the context)
    # does not.
    import torch

    from tandem import LLM, SamplingParams

    report: dict[str, Any] = {}
    if a.after:
        start = time.monotonic()
        report["started_after"] = a.after
        if not arrived(a.after, "ready"):
            report["error"] = f"{a.after} never allocated its KV cache"
            (d / f"{a.name}.json").write_text(json.dumps(report))
            return 1
        report["waited_s"] = time.monotonic() - start
    _reset_peak(a.device)
    with LLM(model=a.model, device=a.device, dtype="bfloat16", max_model_len=a.max_len,
             max_num_seqs=1024, enforce_eager=True, gpu_memory_utilization=a.util) as llm:
        runner = _runner(llm)
        report["kv_cache_bytes"] = runner.kv_cache.numel() * runner.kv_cache.element_size()
        report["num_blocks"] = runner.num_blocks
        report["peer_ready"] = barrier("ready")
        g = torch.Generator().manual_seed(4)
        prompts = torch.randint(0, 1000, (64, 32), generator=g).tolist()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)
        report["num_output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
        report["peak_allocated_bytes"] = _peak(a.device)
        report["peer_done"] = barrier("done")
    (d / f"{a.name}.json").write_text(json.dumps(report))
    return 0 if report["peer_ready"] and report["peer_done"] else 1


def check_two_engines(ctx: Context) -> dict[str, Any]:
    """Two engines on one GPU, as ``tandem up --device cuda`` starts a prefill and a decode
    engine: two processes, each ``gpu_memory_utilization=0.4``, the second building its
    engine only once the first has allocated its KV cache (``engine_worker``'s
    ``--after``; ``tandem up`` starts GPU sharers one after another), both generate while
    the other is up; each one's peak allocation within its share and its KV cache at
    least half of it (``got_its_share``)."""
    s = ctx.sizes
    folder = ensure_model(s["engine_model"], ctx.models)
    d = ctx.out_dir / "two_engines"
    d.mkdir(parents=True, exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    util = s["engines_util"]
    # NOTE: before the engines start: reading the total creates this process's CUDA
    # context, which an engine profiling meanwhile would count as its own.
    total = _total_memory(ctx.device)
    procs = {}
    for name, peer, after in (("a", "b", None), ("b", "a", "a")):
        cmd = [sys.executable, "-P", "-m", "tandem.bench.gpu_check_runs", "engine-worker",
               "--model", str(folder), "--device", ctx.device, "--name", name, "--peer", peer,
               "--dir", str(d), "--util", str(util), "--max-len", str(s["engine_max_len"]),
               "--wait-s", str(max(10.0, ctx.budget_s - 15)), *(["--after", after] if after
                                                                 else [])]
        log = open(d / f"{name}.log", "w")  # noqa: SIM115 - closed below
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    result: dict[str, Any] = {"gpu_memory_utilization": util, "total_bytes": total}
    passed = True
    for name, (proc, log) in procs.items():
        try:
            rc = proc.wait(timeout=max(5.0, ctx.budget_s - 10))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        if name == "a" and rc != 0:
            procs["b"][0].kill()  # it would wait for a's cache until its own deadline
        out = d / f"{name}.json"
        entry: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
        entry["returncode"] = rc
        if rc != 0:
            entry["log_tail"] = (d / f"{name}.log").read_text()[-2000:]
        share = int(util * total) if total else None
        entry["passed"] = rc == 0 and (share is None or got_its_share(
            entry.get("peak_allocated_bytes"), entry.get("kv_cache_bytes"), share))
        passed &= entry["passed"]
        result[name] = entry
    result["passed"] = passed
    return result


# -- the KV store's staging, decode step times ---------------------------------------------------


def staging_round_trip(device: str) -> dict[str, Any]:
    """Blocks of a cache on ``device`` through the KV store's host staging (planned as
    for a sharded cache, so a CPU cache stages too) into another cache; ``passed``:
    they arrive bit-equal and nothing else is written."""
    import torch

    from tandem.engine.kv_shards import ShardedKVCache
    from tandem.kvstore.transfer_path import plan_kv_transfer

    src = torch.randn(64, 4, 2, 16, 2, 64, device=device, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    plan = plan_kv_transfer({torch.device(device).type}, False)
    ids = [3, 4, 5, 9, 40, 63]
    a, b = ShardedKVCache.from_tensor(src), ShardedKVCache.from_tensor(dst)
    buf = torch.empty((len(ids), *a.block_shape), dtype=src.dtype, pin_memory=plan.pinned)
    start = time.perf_counter()
    a.read_blocks(ids, buf)
    b.write_blocks(ids, buf)
    if src.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    ok = bool(torch.equal(dst[ids], src[ids])) and int(dst.count_nonzero()) == int(
        src[ids].count_nonzero())
    return {"passed": ok, "plan": {"path": plan.path.value, "pinned": plan.pinned,
                                   "reason": plan.reason},
            "num_blocks": len(ids), "block_bytes": a.block_bytes, "round_trip_s": elapsed}


def check_kv_staging(ctx: Context) -> dict[str, Any]:
    """``staging_round_trip`` on the check's device."""
    return staging_round_trip(ctx.device)


def step_times(llm: Any, batch: int, steps: int, vocab: int) -> list[float]:
    """Wall times (s) of ``steps`` decode steps of ``batch`` requests: 16-token prompts,
    prefilled in one step first (untimed), then each ``step()`` timed (it returns the
    sampled tokens, so the device is done)."""
    import torch

    from tandem import SamplingParams

    engine = llm.llm_engine
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for row in torch.randint(0, vocab, (batch, 16), generator=g).tolist():
        engine.add_request(engine.new_request_id(), row, params)
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        if len(outs) != batch:
            raise RuntimeError(f"a decode step of batch {batch} returned {len(outs)} outputs "
                               "(a prefill left over, or a request ended early)")
    while engine.has_unfinished_requests():
        engine.step()
    return times


def check_decode_steps(ctx: Context) -> dict[str, Any]:
    """Decode step times at batch 1, 32 and 128 (bfloat16, the SmolLM2-sized random model,
    CUDA graphs on); passes when every batch ran and, on CUDA, each batch size replayed
    its graph."""
    from tandem import LLM

    s = ctx.sizes
    folder = ensure_model(s["engine_model"], ctx.models)
    result: dict[str, Any] = {"model": s["engine_model"], "dtype": "bfloat16", "batches": {}}
    with LLM(model=str(folder), device=ctx.device, dtype="bfloat16", max_model_len=256,
             max_num_seqs=max(s["decode_batches"]), max_num_batched_tokens=2048,
             enable_prefix_caching=False) as llm:
        for batch in s["decode_batches"]:
            t = step_times(llm, batch, s["decode_steps"], vocab=1000)
            result["batches"][str(batch)] = {
                "median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                "max_ms": 1e3 * max(t), "steps": len(t),
                "output_tokens_per_s": batch / statistics.median(t)}
            ctx.save_partial(result)
        graphs = _runner(llm).cuda_graphs
        replays = dict(graphs.num_replays) if graphs is not None else {}
    result["graph_replays_by_size"] = replays
    need = ctx.device.startswith("cuda")
    result["passed"] = not need or all(replays.get(b, 0) > 0 for b in s["decode_batches"])
    return result


CHECKS = {"greedy": check_greedy, "masked_gqa": check_masked_gqa,
          "kv_staging": check_kv_staging, "decode_steps": check_decode_steps,
          "two_engines": check_two_engines}


if __name__ == "__main__":
    if sys.argv[1:2] != ["engine-worker"]:
        sys.exit("usage: python -P -m tandem.bench.gpu_check_runs engine-worker ...")
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    sys.exit(engine_worker(sys.argv[2:]))
