"""Mixture-of-experts kernels: top-k routing as each model family defines it, and the
fused-experts op that runs each expert once per step over the tokens routed to it.

Routing (``select_experts``), one function for every family, by its switches:

- softmax over all experts, top-k, optionally renormalised over the k (Mixtral: Jiang
  et al. 2024, "Mixtral of Experts", always renormalised; Qwen2/3-MoE: ``norm_topk_prob``);
- top-k over the raw logits, softmax over the k (gpt-oss: ``softmax_after_topk``);
- DeepSeek's group-limited top-k: the experts split into ``n_group`` groups, only the
  ``topk_group`` best groups eligible. DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3
  Technical Report", sec. 2.1.2): sigmoid scores, a per-expert ``e_score_correction_bias``
  added for the choice only (the weights are the unbiased scores), a group scored by the
  sum of its two best experts, renormalised, times ``routed_scaling_factor``.
  DeepSeek-V2 (``group_limited_greedy``): softmax scores, a group scored by its best
  expert, times ``routed_scaling_factor``.

Fused experts (``fused_experts``), after vLLM's ``fused_moe``
(``vllm/model_executor/layers/fused_moe``): the ``[num_tokens, top_k]`` (token, expert)
pairs are sorted by expert id (one ``argsort``), the tokens gathered in that order, and
each expert that received tokens runs its packed ``w13`` (gate and up stacked) and ``w2``
once, as one matmul over its contiguous run of rows; the weighted rows are summed back
per token with one ``index_add_``. The Python loop is over the experts that received
tokens (at most ``num_experts`` iterations, two matmuls each), never over tokens; when
most experts are hit (a decode batch of dozens of tokens, a prefill) each expert's run is
padded to the longest and all experts go through two ``torch.bmm`` calls instead.
``fused_experts_ref`` is the per-token loop, the oracle of the tests.

Under expert parallelism a rank holds experts ``[expert_start, expert_start + E_local)``;
pairs routed to other ranks' experts are dropped here and added by the caller's
all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: ``fused_experts`` activations: "silu" is SwiGLU (Shazeer 2020) ``silu(gate) * up``;
#: "swiglu_oai" is gpt-oss's clamped variant (``swiglu_oai``).
ACTIVATIONS = ("silu", "swiglu_oai")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    softmax_after_topk: bool = False,
    n_group: int | None = None,
    topk_group: int | None = None,
    group_score: str = "top2_sum",
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights.

    Args:
        router_logits: ``[num_tokens, num_experts]`` (any float dtype; scored in float32,
            except with ``softmax_after_topk``, which keeps the logits' dtype as gpt-oss).
        top_k: experts per token (``num_experts_per_tok``).
        scoring: "softmax" or "sigmoid" (DeepSeek-V3).
        renormalize: divide the k weights by their sum (``norm_topk_prob``; Mixtral always).
        softmax_after_topk: gpt-oss: top-k of the logits, then softmax over the k.
        n_group / topk_group: group-limited routing (DeepSeek): ``num_experts`` split into
            ``n_group`` equal groups, experts of the ``topk_group`` best groups eligible.
        group_score: how a group is scored: "top2_sum" (V3: its two best biased scores)
            or "max" (V2's ``group_limited_greedy``: its best score).
        correction_bias: ``[num_experts]`` added to the scores for the choice only
            (DeepSeek-V3's ``e_score_correction_bias``).
        routed_scaling_factor: multiplies the final weights (DeepSeek).

    Returns:
        ``(weights, ids)``: ``[num_tokens, top_k]`` float32 (the logits' dtype with
        ``softmax_after_topk``) and int64; the order of the k is unspecified.

    Raises:
        ValueError: an unknown ``scoring`` / ``group_score``, ``top_k`` outside
            ``[1, num_experts]``, or ``num_experts`` not divisible by ``n_group``.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if softmax_after_topk:
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype), ids
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group is not None and n_group > 1:
        choice = _group_limit(choice, n_group, int(topk_group or n_group), group_score)
    if correction_bias is None and (n_group is None or n_group <= 1):
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        ids = torch.topk(choice, top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    if renormalize:
        # DeepSeek-V3 adds 1e-20 so that an all-zero row stays finite; the others divide.
        eps = 1e-20 if scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def _group_limit(choice: torch.Tensor, n_group: int, topk_group: int, how: str) -> torch.Tensor:
    """``choice [T, E]`` with the experts outside each token's ``topk_group`` best groups
    masked: to -inf for "top2_sum" (DeepSeek-V3), to 0 for "max" (V2, softmax scores)."""
    num_tokens, num_experts = choice.shape
    if num_experts % n_group:
        raise ValueError(f"num_experts {num_experts} must be divisible by n_group {n_group}")
    grouped = choice.view(num_tokens, n_group, num_experts // n_group)
    if how == "top2_sum":
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        fill = float("-inf")
    elif how == "max":
        group_scores = grouped.max(dim=-1).values
        fill = 0.0
    else:
        raise ValueError(f"group_score must be 'top2_sum' or 'max', got {how!r}")
    group_idx = torch.topk(group_scores, topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), fill).view(num_tokens, num_experts)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (OpenAI 2025, gpt-oss model card; transformers'
    ``GptOssExperts._apply_gate``): ``gate`` clamped above at ``limit``, ``up`` to
    ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``.

    ``gate_up [rows, 2 * I]`` (gate first, then up: the de-interleaved layout the loader
    stores) -> ``[rows, I]``, same dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return swiglu_oai(gate_up, alpha, limit)


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("x must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    e, two_i, h = w13.shape
    if h != x.shape[1] or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [num_tokens={x.shape[0]}, top_k]"
        )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    expert_start: int = 0,
) -> torch.Tensor:
    """The experts' weighted sum for each token, each expert run once over its tokens.

    Args:
        x: ``[num_tokens, hidden]`` (float32 / bfloat16 / float16).
        w13: ``[E_local, 2 * I, hidden]``: each expert's gate rows, then its up rows.
        w2: ``[E_local, hidden, I]``: each expert's down projection.
        topk_weights: ``[num_tokens, top_k]`` (any float dtype; cast to ``x``'s).
        topk_ids: ``[num_tokens, top_k]`` int64 global expert ids.
        w13_bias / w2_bias: ``[E_local, 2 * I]`` / ``[E_local, hidden]`` or ``None`` (gpt-oss).
        activation: "silu" or "swiglu_oai" (with ``alpha`` and ``limit``).
        expert_start: global id of local expert 0 (expert parallelism); ids outside
            ``[expert_start, expert_start + E_local)`` contribute nothing here.

    Returns:
        ``[num_tokens, hidden]`` in ``x``'s dtype: ``sum_j weight_j * expert_{id_j}(x)``
        over the local experts.

    Raises:
        ValueError: shapes that do not fit, an unknown ``activation``.
    """
    _check(x, w13, w2, topk_ids, topk_weights, activation)
    num_tokens, top_k = topk_ids.shape
    num_local = w13.shape[0]
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat = topk_ids.reshape(-1) - expert_start
    # Pairs of other ranks' experts get the sentinel id num_local: they sort last and
    # are cut off before any matmul.
    flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_local + 1).tolist()
    rows = sum(counts[:num_local])
    if rows == 0:
        return out
    order = order[:rows]
    xs = x.index_select(0, order // top_k)
    inter = w2.shape[2]
    cap = max(counts[:num_local])
    active = sum(1 for c in counts[:num_local] if c)
    # Decode steps read every hit expert's weights whatever the padding (memory bound):
    # up to 16 rows per expert pad freely; past that the padding's FLOPs count (4x).
    if 2 * active >= num_local and cap * num_local <= max(4 * rows, 16 * num_local):
        down = _padded_bmm(xs, flat.index_select(0, order), counts[:num_local], cap, w13, w2,
                           w13_bias, w2_bias, activation, alpha, limit)
    else:
        down = _grouped_loop(xs, counts[:num_local], w13, w2, w13_bias, w2_bias, activation,
                             alpha, limit, inter)
    # Each pair's row back at its (token, j) place, then the weighted sum over the k as one
    # batched matmul (no scatter-add; pairs of other ranks' experts stay zero).
    pairs = x.new_zeros(num_tokens * top_k, x.shape[1]).index_copy_(0, order, down)
    w = topk_weights.to(x.dtype).view(num_tokens, 1, top_k)
    return torch.bmm(w, pairs.view(num_tokens, top_k, -1)).squeeze(1)


def _grouped_loop(xs: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor,
                  w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
                  activation: str, alpha: float, limit: float, inter: int) -> torch.Tensor:
    """``xs [rows, H]`` sorted by expert (``counts`` rows each) -> ``[rows, H]``: one
    matmul per expert that has rows (few experts hit: only their weights are read)."""
    rows = xs.shape[0]
    gate_up = xs.new_empty(rows, 2 * inter)
    bounds: list[tuple[int, int, int]] = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            bounds.append((e, start, start + n))
            torch.mm(xs[start : start + n], w13[e].t(), out=gate_up[start : start + n])
            if w13_bias is not None:
                gate_up[start : start + n] += w13_bias[e]
            start += n
    # One activation over every expert's rows (elementwise: the grouping does not matter).
    act = _activate(gate_up, activation, alpha, limit)
    down = xs.new_empty(rows, xs.shape[1])
    for e, s, t in bounds:
        torch.mm(act[s:t], w2[e].t(), out=down[s:t])
        if w2_bias is not None:
            down[s:t] += w2_bias[e]
    return down


def _padded_bmm(xs: torch.Tensor, sorted_ids: torch.Tensor, counts: list[int], cap: int,
                w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None,
                w2_bias: torch.Tensor | None, activation: str, alpha: float,
                limit: float) -> torch.Tensor:
    """As ``_grouped_loop``, each expert's rows padded to ``cap`` and all experts in two
    ``torch.bmm`` calls: when most experts are hit (decode batches, prefills) one
    parallel region per projection instead of one per expert (on a loaded small CPU the
    per-expert loop's thread fork/joins cost several times the matmuls;
    docs/benchmarks.md)."""
    num_local, hidden = w13.shape[0], xs.shape[1]
    starts = torch.tensor([0, *counts[:-1]], dtype=torch.int64).cumsum(0)
    slot = sorted_ids * cap + (torch.arange(xs.shape[0]) - starts.index_select(0, sorted_ids))
    padded = xs.new_zeros(num_local * cap, hidden).index_copy_(0, slot, xs)
    gate_up = torch.bmm(padded.view(num_local, cap, hidden), w13.transpose(1, 2))
    if w13_bias is not None:
        gate_up += w13_bias.unsqueeze(1)
    act = _activate(gate_up, activation, alpha, limit)
    down = torch.bmm(act, w2.transpose(1, 2))
    if w2_bias is not None:
        down += w2_bias.unsqueeze(1)
    return down.view(num_local * cap, hidden).index_select(0, slot)


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    expert_start: int = 0,
) -> torch.Tensor:
    """``fused_experts`` as a loop over tokens and their k experts (the tests' oracle):
    same arguments, result and errors; float32 accumulation per token."""
    _check(x, w13, w2, topk_ids, topk_weights, activation)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j]) - expert_start
            if not 0 <= e < w13.shape[0]:
                continue
            h = F.linear(x[t : t + 1], w13[e], None if w13_bias is None else w13_bias[e])
            y = F.linear(_activate(h, activation, alpha, limit), w2[e],
                         None if w2_bias is None else w2_bias[e])
            out[t] += float(topk_weights[t, j]) * y[0].float()
    return out.to(x.dtype)
