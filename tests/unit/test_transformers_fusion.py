"""``transformers_fusion``: sibling projections sharing one GEMM, and the probe that
keeps only the groups whose module calls every sibling on the same input."""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.models.transformers_fusion import FusedProjection, fuse_projections


def _linears(*outs: int, bias: bool = False, seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(8, n, bias=bias) for n in outs]


def test_parts_equal_each_linear_and_follow_a_new_input() -> None:
    lins = _linears(4, 2, 2, bias=True)
    fused = FusedProjection(lins)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        for inp in (x, y):
            for i, lin in enumerate(lins):
                torch.testing.assert_close(fused.part(i, inp), lin(inp))
        assert fused.complete and not fused.broken
        # q of x, then q of y before k and v took x's: recomputed, and marked
        torch.testing.assert_close(fused.part(0, x), lins[0](x))
        torch.testing.assert_close(fused.part(0, y), lins[0](y))
        torch.testing.assert_close(fused.part(1, y), lins[1](y))
    assert fused.broken


def test_in_place_change_between_siblings_is_not_served_from_the_cache() -> None:
    lins = _linears(4, 4)
    fused = FusedProjection(lins)
    x = torch.randn(2, 8)
    with torch.no_grad():
        fused.part(0, x)
        x.mul_(2.0)
        torch.testing.assert_close(fused.part(1, x), lins[1](x))
    assert fused.broken


class _SharedInput(nn.Module):
    """Llama-like: q/k/v of one input, gate/up of one input."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = _linears(4, 2, 2, seed=1)
        self.gate_proj, self.up_proj = _linears(6, 6, seed=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        return qkv.sum(-1, keepdim=True) + self.gate_proj(x) * self.up_proj(x)


class _OtherInputs(nn.Module):
    """k and v of another tensor than q (cross-attention-like): nothing shared."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = _linears(4, 4, 4, seed=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return self.q_proj(x) + self.k_proj(h) + self.v_proj(h)


def test_probe_keeps_shared_groups_and_reverts_the_others() -> None:
    model = nn.ModuleDict({"a": _SharedInput(), "b": _OtherInputs()})
    x = torch.randn(5, 8)
    with torch.no_grad():
        want_a, want_b = model["a"](x), model["b"](x)
        originals_b = [model["b"].q_proj, model["b"].k_proj, model["b"].v_proj]
        report = fuse_projections(model, lambda: (model["a"](x), model["b"](x)))
        assert sorted(report.fused) == ["a:gate_proj,up_proj", "a:q_proj,k_proj,v_proj"]
        assert report.reverted == ("b:q_proj,k_proj,v_proj",)
        assert isinstance(model["a"].fused_q_k_v, FusedProjection)
        assert model["a"].fused_q_k_v.linear.weight.shape == (8, 8)
        assert isinstance(model["a"].fused_gate_up, FusedProjection)
        assert [model["b"].q_proj, model["b"].k_proj, model["b"].v_proj] == originals_b
        assert not hasattr(model["b"], "fused_q_k_v")
        torch.testing.assert_close(model["a"](x), want_a)
        torch.testing.assert_close(model["b"](x), want_b)
    # the fused linear is one module of the tree (packed once), the slices hold no weight
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert sorted(linears) == ["a.fused_gate_up.linear", "a.fused_q_k_v.linear",
                               "b.k_proj", "b.q_proj", "b.v_proj"]


def test_a_failing_probe_reverts_every_group() -> None:
    model = _SharedInput()
    q = model.q_proj

    def probe() -> None:
        raise RuntimeError("view size is not compatible with input tensor's size and stride")

    report = fuse_projections(model, probe)
    assert report.fused == () and len(report.reverted) == 2
    assert model.q_proj is q and type(model.gate_proj) is nn.Linear


def test_siblings_that_cannot_share_a_gemm_are_left_alone() -> None:
    model = _SharedInput()
    model.v_proj = nn.Linear(8, 2, bias=True)  # q/k without bias: no common GEMM
    report = fuse_projections(model, lambda: model(torch.randn(2, 8)))
    assert report.fused == (":gate_proj,up_proj",)
    assert type(model.q_proj) is nn.Linear
