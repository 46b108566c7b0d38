"""GPU paths of quantized weights against the torch references: the Triton W4A16 / W8A16
GEMM (``kernels/quant/triton_grouped.py``) on the CPU via Triton's interpreter, the FP8
``_scaled_mm`` paths (``kernels/quant/fp8_gemm.py``) on torch's CPU ``_scaled_mm``, and
the capability rule. With ``TANDEM_TEST_DEVICE=cuda`` (``make gpu-check``) the kernels
run natively and the layers' CUDA dispatch is checked too. See
``tests/unit/test_kernels_triton.py`` for why the module may re-run in a fresh interpreter.
"""

from __future__ import annotations

import copy
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

from torch import nn  # noqa: E402

from tandem.engine.quantization.dense_linear import Fp8Linear  # noqa: E402
from tandem.engine.quantization.methods import Int4OnLoad, Int8OnLoad  # noqa: E402
from tandem.kernels.quant.fp8_gemm import (  # noqa: E402
    Fp8Path,
    fp8_gemm_path,
    fp8_scaled_mm_linear,
    quantize_fp8_per_token,
)
from tandem.kernels.quant.grouped import grouped_linear_reference  # noqa: E402
from tandem.kernels.quant.packing import to_canonical  # noqa: E402
from tandem.kernels.quant.triton_grouped import (  # noqa: E402
    grouped_linear_triton,
    int8_weight_linear_triton,
)

DEVICE = "cuda" if NATIVE else "cpu"
in_process = pytest.mark.skipif(
    _TRITON_PREIMPORTED, reason="triton imported without the interpreter: see the rerun"
)
native_only = pytest.mark.skipif(not NATIVE, reason="the layers dispatch to CUDA only on a GPU")
# NOTE: no bfloat16 under the interpreter: it computes through numpy, which has none.
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if NATIVE else [])]
#: max |kernel - reference| over max |reference|: float32 rounding of a different
#: summation order, or one rounding of the output (and of the bias add) in 16 bits
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
#: K: two groups of 128 (or eight of 32); N: not a multiple of the 64-column tile
K, N = 256, 48


@pytest.mark.skipif(not _TRITON_PREIMPORTED, reason="running in this process")
def test_rerun_in_fresh_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def make_grouped(bits: int, group_size: int, with_zeros: bool, act_order: bool,
                 with_bias: bool, dtype: torch.dtype, k: int = K, n: int = N, seed: int = 0):
    """Random canonical-layout weights: ``(q, scales, zeros, perm, bias)`` on ``DEVICE``;
    scales keep outputs near 1 so the tolerance is about rounding, not magnitude."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << bits, (n, k), generator=g)
    groups = (n, k // group_size)
    scales = (torch.rand(groups, generator=g) * 0.02 + 0.005) * (16 / (1 << bits))
    zeros = torch.randint(0, 1 << bits, groups, generator=g).float() if with_zeros else None
    perm = torch.randperm(k, generator=g) if act_order else None
    bias = torch.randn(n, generator=g) if with_bias else None

    def dev(t, dt=None):
        return None if t is None else t.to(device=DEVICE, dtype=dt or t.dtype)

    return (dev(to_canonical(values, bits)), dev(scales, dtype), dev(zeros), dev(perm),
            dev(bias, dtype))


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= REL_TOL[dtype] * scale, f"max error {err} at output scale {scale}"


def run_both(x, q, scales, zeros, bits, group_size, perm, bias):
    """The kernel's output and the reference's (computed on the CPU)."""
    got = grouped_linear_triton(x, q, scales, zeros, bits, group_size, perm, bias)

    def cpu(t):
        return None if t is None else t.cpu()

    want = grouped_linear_reference(x.cpu(), q.cpu(), scales.cpu(), cpu(zeros), bits,
                                    group_size, cpu(perm), cpu(bias))
    return got.cpu(), want


# NOTE: zero points and bias vary together: each is its own compile-time branch, so the
# two combinations test both sides of each with half the native compilations.
@in_process
@pytest.mark.parametrize("act_order", [False, True], ids=["inorder", "actorder"])
@pytest.mark.parametrize("with_zeros, with_bias", [(False, False), (True, True), (False, True)],
                         ids=["symmetric", "zeros-bias", "symmetric-bias"])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_matches_reference(bits, group_size, with_zeros, with_bias, act_order):
    """The layout variants at a small batch (M = 5), float32."""
    q, s, z, perm, bias = make_grouped(bits, group_size, with_zeros, act_order, with_bias,
                                       torch.float32)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got, want = run_both(x, q, s, z, bits, group_size, perm, bias)
    assert_rel_close(got, want, torch.float32)


@in_process
@pytest.mark.parametrize("m", [1, 5, 80], ids=["decode1", "decode5", "prefill80"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_batch_sizes_and_dtypes(bits, dtype, m):
    """M from one token to a prefill of two 64-row tiles (the second partial), in each
    activation dtype, with zero points, act-order and a bias."""
    q, s, z, perm, bias = make_grouped(bits, 128, True, True, True, dtype)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    got, want = run_both(x, q, s, z, bits, 128, perm, bias)
    assert_rel_close(got, want, dtype)


@in_process
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_group_size_not_a_multiple_of_16(bits):
    """A group size no K tile divides (24): each element reads its own group's scale."""
    q, s, z, perm, bias = make_grouped(bits, 24, True, False, False, torch.float32, k=96)
    x = torch.randn(3, 2, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    got, want = run_both(x, q, s, z, bits, 24, perm, bias)
    assert got.shape == (3, 2, N)
    assert_rel_close(got, want, torch.float32)


@in_process
def test_int8_weight_only_matches_dequantized_product():
    """``Int8Linear``'s GPU path: signed int8 rows times their scales, weight-only."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.01 + 0.001
    bias = torch.randn(N, generator=g)
    x = torch.randn(7, K, generator=g)
    got = int8_weight_linear_triton(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE),
                                    bias.to(DEVICE)).cpu()
    want = x @ (q.float() * scale[:, None]).T + bias
    assert_rel_close(got, want, torch.float32)


def _bad(name: str):
    """Arguments of ``grouped_linear_triton`` with ``name`` made wrong."""
    q, s, z, perm, bias = make_grouped(4, 32, True, True, True, torch.float32, k=64, n=16)
    args = {"x": torch.randn(2, 64, device=DEVICE), "q": q, "scales": s, "zeros": z,
            "bits": 4, "group_size": 32, "perm": perm, "bias": bias}
    bad = {
        "x": torch.randn(2, 64, device=DEVICE).to(torch.int32),
        "q": q[:, :-1],
        "scales": s[:, :1],
        "zeros": z[:-1],
        "perm": perm.to(torch.int32) if perm is not None else None,
        "bias": torch.randn(15, device=DEVICE),
        "bits": 3,
        "group_size": 48,
    }
    args[name] = bad[name]
    return args


@pytest.mark.parametrize("name", ["x", "q", "scales", "zeros", "perm", "bias", "bits",
                                  "group_size"])
def test_bad_arguments_name_the_argument(name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        grouped_linear_triton(**_bad(name))


def test_4bit_weight_given_as_int8_is_refused():
    q = torch.zeros(16, 32, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="q must be"):
        grouped_linear_triton(torch.randn(1, 64, device=DEVICE), q,
                              torch.ones(16, 2, device=DEVICE), None, 4, 32)


# -- FP8 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("capability, dtype, n, k, block, want", [
    (None, torch.bfloat16, 64, 64, False, Fp8Path.DEQUANT),
    ((8, 0), torch.bfloat16, 64, 64, False, Fp8Path.DEQUANT),
    ((8, 6), torch.float16, 64, 64, False, Fp8Path.DEQUANT),
    ((8, 9), torch.bfloat16, 64, 64, False, Fp8Path.EPILOGUE),
    ((8, 9), torch.float16, 64, 64, False, Fp8Path.EPILOGUE),
    ((9, 0), torch.bfloat16, 64, 64, False, Fp8Path.ROWWISE),
    ((9, 0), torch.float16, 64, 64, False, Fp8Path.EPILOGUE),
    ((9, 0), torch.float32, 64, 64, False, Fp8Path.EPILOGUE),
    ((10, 0), torch.bfloat16, 64, 64, False, Fp8Path.ROWWISE),
    ((9, 0), torch.bfloat16, 64, 64, True, Fp8Path.DEQUANT),
    ((9, 0), torch.bfloat16, 40, 64, False, Fp8Path.DEQUANT),
    ((9, 0), torch.bfloat16, 64, 72, False, Fp8Path.DEQUANT),
])
def test_fp8_path_rule(capability, dtype, n, k, block, want):
    assert fp8_gemm_path(capability, dtype, n, k, block) is want


def _fp8_weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=g) * 1e-3 + 1e-4
    return w8, scale


def _needs_fp8_gemm(path: Fp8Path) -> None:
    """Natively: skip where this GPU has no such path (the rule above decides)."""
    if NATIVE:
        cap = torch.cuda.get_device_capability()
        if fp8_gemm_path(cap, torch.bfloat16, 64, 64) is Fp8Path.DEQUANT:
            pytest.skip(f"capability {cap} has no FP8 GEMM")
        if path is Fp8Path.ROWWISE and fp8_gemm_path(cap, torch.bfloat16, 64, 64) is not path:
            pytest.skip(f"capability {cap} has no row-wise _scaled_mm")


@pytest.mark.parametrize("path, dtype", [(Fp8Path.EPILOGUE, torch.float32),
                                         (Fp8Path.EPILOGUE, torch.float16),
                                         (Fp8Path.ROWWISE, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("m", [1, 33])
def test_fp8_scaled_mm_equals_its_quantized_operands(path, dtype, m):
    """The GEMM equals the product of the per-token FP8 activations and the scaled FP8
    weight (both exact in float32) within the output's rounding; and is close to the
    unquantized activations' product within E4M3's activation rounding."""
    _needs_fp8_gemm(path)
    n, k = 48, 64
    w8, scale = _fp8_weight(n, k, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    got = fp8_scaled_mm_linear(x.to(DEVICE), w8.to(DEVICE), scale.to(DEVICE),
                               bias.to(DEVICE), path).cpu()
    assert got.shape == (m, n) and got.dtype == dtype
    w = w8.float() * scale[:, None]
    xq, sx = quantize_fp8_per_token(x)
    exact = (xq.float() * sx) @ w.T + bias.float()
    assert_rel_close(got, exact.to(dtype), dtype if dtype != torch.float32 else torch.float16)
    loose = (got.float() - (x.float() @ w.T + bias.float())).abs().max()
    assert loose <= 0.1 * exact.abs().max()


def test_fp8_scaled_mm_refuses_the_dequant_path_and_bad_shapes():
    w8, scale = _fp8_weight(16, 32, seed=7)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="DEQUANT"):
        fp8_scaled_mm_linear(x, w8, scale, None, Fp8Path.DEQUANT)
    with pytest.raises(ValueError, match="w8"):
        fp8_scaled_mm_linear(x, w8.float(), scale, None, Fp8Path.EPILOGUE)
    with pytest.raises(ValueError, match="scale"):
        fp8_scaled_mm_linear(x, w8, scale[:8], None, Fp8Path.EPILOGUE)
    with pytest.raises(ValueError, match="bias"):
        fp8_scaled_mm_linear(x, w8, scale, torch.zeros(3), Fp8Path.EPILOGUE)
    empty = fp8_scaled_mm_linear(x[:0], w8, scale, None, Fp8Path.EPILOGUE)
    assert empty.shape == (0, 16) and empty.dtype == x.dtype


# -- the layers' CUDA dispatch (GPU only) ---------------------------------------------------


@native_only
@pytest.mark.parametrize("method", [Int4OnLoad(), Int8OnLoad()], ids=["int4", "int8"])
def test_on_load_layers_on_cuda_match_their_cpu_copy(method):
    """int4 (``Int4Linear``) and int8 (``Int8Linear``), weight-only on the GPU, on CUDA
    against the same layer's CPU path (W4A8 / W8A8: it also rounds the activations,
    hence the bound of 4 bf16 steps)."""
    torch.manual_seed(8)
    linear = nn.Linear(K, N, bias=True, dtype=torch.bfloat16, device="cpu")
    cpu_layer = method.quantize_linear(linear, "layer")
    gpu_layer = method.quantize_linear(copy.deepcopy(linear).to("cuda"), "layer")
    x = torch.randn(9, K, dtype=torch.bfloat16)
    got = gpu_layer(x.to("cuda")).cpu().float()
    want = cpu_layer(x).float()
    tol = REL_TOL[torch.bfloat16] * 4
    assert (got - want).abs().max() <= tol * want.abs().max()


@native_only
def test_fp8_layer_on_cuda_matches_the_dequantized_product():
    torch.manual_seed(9)
    n, k = 64, 128
    layer = Fp8Linear(k, n, [n], False, torch.bfloat16, "channel").to("cuda")
    w8, scale = _fp8_weight(n, k, seed=10)
    layer.weight.data.copy_(w8)
    layer.weight_scale.data.copy_(scale.view(n, 1))
    layer.finish_loading("layer")
    x = torch.randn(5, k, dtype=torch.bfloat16)
    got = layer(x.to("cuda")).cpu().float()
    want = x.float() @ (w8.float() * scale[:, None]).T
    assert (got - want).abs().max() <= 0.1 * want.abs().max()
