"""The GPU check's pass rules (bench/gpu_check.py, bench/gpu_check_runs.py): pure functions
of what a check measured, tested on the CPU in tests/unit/test_gpu_check.py, and
``divergences``, which measures what the greedy rule needs.

Greedy near-ties: tandem's greedy tokens may leave transformers' only where the two
candidates are about equally likely. Where a prompt's tokens first differ (index ``i``,
transformers' token ``a``, tandem's ``b``), transformers in float32 (the judge: the same
weights, which bfloat16 holds exactly) is run on the common prefix; ``gap`` is its logit of
``a`` minus that of ``b``, and ``noise`` the largest difference there between the
check's-dtype transformers logits and the judge's, over the judge's top 8 and ``a``, ``b``
(the rounding of that dtype at that very position). The divergence is a near-tie when
``|gap| <= max(TIE_FLOOR[dtype], TIE_NOISE_FACTOR * noise)``: an engine's rounding moves a
logit by about ``noise`` and the difference of two logits by up to twice that, and both
engines round, hence 4. On these random weights bfloat16 leaves float32 within ~20 tokens
in most prompts (transformers bf16 vs float32 on the CPU: gaps up to 2.0 x noise over 50
divergences), which a fixed logit gap either fails or widens until a broken kernel passes.
"""

from __future__ import annotations

from typing import Any

#: the absolute floor of a near-tie's logit gap, per dtype (float32: reduction orders)
TIE_FLOOR = {"float32": 1e-3, "bfloat16": 0.02}
TIE_NOISE_FACTOR = 4.0
#: a run's allocations may pass its memory budget by this much (sampler buffers and the like)
MEMORY_SLACK_BYTES = 64 << 20
MEMORY_SLACK_FRACTION = 0.02
#: an engine sharing a GPU gets at least this fraction of its share as KV cache (the
#: weights and a step's activations of the models here take far less than the rest)
KV_SHARE_MIN = 0.5


def tie_threshold(noise: float, dtype: str) -> float:
    """The largest ``|gap|`` a divergence in ``dtype`` may have to count as a near-tie."""
    return max(TIE_FLOOR[dtype], TIE_NOISE_FACTOR * noise)


def is_near_tie(div: dict[str, Any], dtype: str) -> bool:
    """Whether one divergence record (``divergences``) is a near-tie; a length mismatch
    (equal tokens, one list longer) never is."""
    if div.get("length_mismatch"):
        return False
    return abs(div["gap"]) <= tie_threshold(div["noise"], dtype)


def greedy_passed(entry: dict[str, Any], dtype: str, need_replays: bool) -> bool:
    """A greedy comparison passes when every divergence is a near-tie and, where CUDA
    graphs are expected (``need_replays``), at least one graph replayed."""
    ties = all(is_near_tie(d, dtype) for d in entry["divergences"])
    return ties and (bool(entry.get("graph_replays_by_size")) or not need_replays)


def within_budget(peak_bytes: int | None, budget_bytes: int) -> bool:
    """A run's peak allocation is within its memory budget (plus the slack); a device
    without a peak counter (the CPU, ``None``) cannot fail this rule."""
    if peak_bytes is None:
        return True
    slack = MEMORY_SLACK_BYTES + MEMORY_SLACK_FRACTION * budget_bytes
    return peak_bytes <= budget_bytes + slack


def got_its_share(peak_bytes: int | None, kv_cache_bytes: int | None, share_bytes: int) -> bool:
    """One of several engines on a GPU used its share well: its peak allocation within the
    share, and its KV cache at least ``KV_SHARE_MIN`` of it (an engine that counted the
    other's memory as its own would size a cache of almost nothing)."""
    if peak_bytes is None or kv_cache_bytes is None:
        return False
    return within_budget(peak_bytes, share_bytes) and kv_cache_bytes >= KV_SHARE_MIN * share_bytes


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far two lists of token lists agree: equal lists, equal first tokens and the
    common prefix of each pair."""
    def prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                    min(len(x), len(y)))

    same = [x == y for x, y in zip(a, b, strict=True)]
    return {"num_prompts": len(a), "num_equal": sum(same),
            "first_token_equal": all(x[:1] == y[:1] for x, y in zip(a, b, strict=True)),
            "common_prefix_tokens": [prefix(x, y) for x, y in zip(a, b, strict=True)]}


def divergences(judge: Any, hf: Any, prompts: list[list[int]], ref: list[list[int]],
                got: list[list[int]], dtype: str) -> list[dict[str, Any]]:
    """One record per prompt whose tokens ``got`` leave ``ref``: the index, both tokens,
    the judge's ``gap`` and ``noise`` there (module docstring), the threshold and whether
    it is a near-tie. ``judge``: transformers in float32; ``hf``: in ``dtype`` (the judge
    itself for float32)."""
    import torch

    found: list[dict[str, Any]] = []
    for k, (prompt, a, b) in enumerate(zip(prompts, ref, got, strict=True)):
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if i is None:
            if len(a) != len(b):
                found.append({"prompt": k, "index": min(len(a), len(b)),
                              "length_mismatch": True, "near_tie": False})
            continue
        ids = torch.tensor([prompt + a[:i]], device=judge.device)
        with torch.inference_mode():
            exact = judge(input_ids=ids).logits[0, -1].float()
            rounded = exact if hf is judge else hf(input_ids=ids).logits[0, -1].float()
        cand = sorted(set(exact.topk(8).indices.tolist()) | {a[i], b[i]})
        noise = float((rounded[cand] - exact[cand]).abs().max())
        rec = {"prompt": k, "index": i, "ref_token": a[i], "token": b[i],
               "gap": float(exact[a[i]] - exact[b[i]]), "noise": noise,
               "threshold": tie_threshold(noise, dtype),
               "rank": int((exact > exact[b[i]]).sum())}
        rec["near_tie"] = is_near_tie(rec, dtype)
        found.append(rec)
    return found
