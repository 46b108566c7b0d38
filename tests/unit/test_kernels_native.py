"""The native kernel library's build variants, its bindings and the backend selection.

The kernels' results per variant are checked in test_kernels.py and
test_fused_decode.py (conftest's ``native_variant``); here: every variant
compiles on any x86-64 machine, the bindings come from the header and cannot
take another argument list, and the selection picks what the CPU can run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from native_variants import on_variant

from tandem.kernels import backend, native_abi, native_build
from tandem.kernels.backend import KernelBackend, KernelBackends, KernelConfig, Platform

_COMPILER = native_build.find_compiler(None)


@pytest.mark.skipif(_COMPILER is None, reason="no C compiler here")
@pytest.mark.parametrize("variant", native_build.X86_64_VARIANTS, ids=lambda v: v.name)
def test_every_x86_64_variant_compiles(variant):
    """Each variant's sources compile here, whether or not this CPU can run them
    (an AVX-512 or AMX syntax or type error fails on an AVX2-only machine)."""
    if Platform.detect().machine != "x86_64":
        pytest.skip("x86-64 variants need an x86-64 compiler")
    native_build.compile_check(variant, _COMPILER)


def test_compile_check_reports_the_compiler_error(tmp_path, monkeypatch):
    """A source that does not compile is a RuntimeError carrying the compiler's message."""
    if _COMPILER is None:
        pytest.skip("no C compiler here")
    (tmp_path / "broken.c").write_text("int f(void) { return undeclared_name; }\n")
    monkeypatch.setattr(native_build, "CSRC", tmp_path)
    monkeypatch.setattr(native_build, "SOURCES", (("broken.c", ()),))
    with pytest.raises(RuntimeError, match="undeclared_name"):
        native_build.compile_check(native_build.X86_64_VARIANTS[0], _COMPILER)


def test_header_declares_what_the_wrappers_call():
    """The parsed header: constants, both structs field by field, every prototype."""
    abi = native_abi.ABI
    assert abi.constants["TANDEM_MAX_HEADS"] == 256
    assert [f.name for f in abi.structs["decode_layer"]][:3] == ["input_norm", "post_norm", "wqkv"]
    assert ctypes.sizeof(native_abi.struct("decode_layer")) == 25 * 8
    assert abi.structs["decode_layer"][-9] == native_abi.CParam("d8", "int8_weight", True)
    assert abi.structs["decode_layer"][-5] == native_abi.CParam("dq", "gguf_weight", True)
    assert abi.structs["decode_layer"][-1] == native_abi.CParam("d4", "int4_weight", True)
    assert ctypes.sizeof(native_abi.struct("int8_weight")) == 4 * 8
    assert ctypes.sizeof(native_abi.struct("gguf_weight")) == 3 * 8
    assert ctypes.sizeof(native_abi.struct("int4_weight")) == 4 * 8
    step = native_abi.struct("decode_step")
    assert [name for name, _ in step._fields_][-6:] == ["pad", "int8_path", "gate_up",
                                                        "int8_scratch", "gguf_scratch",
                                                        "int4_scratch"]
    assert len(abi.prototypes["paged_decode_attention"].params) == 27
    assert abi.prototypes["bf16_pack_weight"].restype == "void"
    assert abi.prototypes["decode_layers"].params[0] == native_abi.CParam(
        "layers", "decode_layer", True
    )


@pytest.mark.parametrize(
    "text,match",
    [
        ("int f(double x);", "unsupported scalar type 'double'"),
        ("int f(const char *s);", "pointer to unknown type 'char'"),
        ("long f(int x);", "cannot read prototype"),
        ("typedef struct { short a; } s;", "unsupported scalar type 'short'"),
    ],
)
def test_header_parser_rejects_what_it_cannot_bind(text, match):
    """A declaration outside the header's subset fails loudly, never binds wrongly."""
    with pytest.raises(ValueError, match=match):
        native_abi.parse_header(text)


def test_parser_reads_several_fields_per_line_and_void_params():
    abi = native_abi.parse_header(
        "#define TANDEM_X 7\ntypedef struct { const int64_t *a, *b; float c; } pair;\n"
        "int g(void);\nvoid h(const pair *p, int n); /* comment */\n"
    )
    assert abi.constants == {"TANDEM_X": 7}
    assert abi.structs["pair"] == (
        native_abi.CParam("a", "int64_t", True),
        native_abi.CParam("b", "int64_t", True),
        native_abi.CParam("c", "float", False),
    )
    assert abi.prototypes["g"].params == ()
    assert [p.name for p in abi.prototypes["h"].params] == ["p", "n"]


@pytest.mark.usefixtures("native_variant")
def test_bound_functions_take_exactly_the_declared_arguments():
    """ctypes passes surplus arguments on silently; the bindings refuse them."""
    from tandem.kernels import cpu_ext

    lib = cpu_ext.load()
    assert lib is not None
    with pytest.raises(TypeError, match=r"silu_and_mul\(is_bf16, x, out, .*takes 6 arguments"):
        lib.silu_and_mul(1, None, None, 0, 0, 1, 99)
    with pytest.raises(TypeError, match="takes 6 arguments, got 5"):
        lib.silu_and_mul(1, None, None, 0, 0)
    with pytest.raises(AttributeError, match="declares no function 'no_such_kernel'"):
        lib.no_such_kernel  # noqa: B018
    assert lib.silu_and_mul(1, None, None, 0, 0, 1) == 0  # zero tokens: nothing read


def _platform(flags: set[str], machine: str = "x86_64") -> Platform:
    return Platform(system="Linux", machine=machine, cpu_flags=frozenset(flags), triton=False)


def _flags_of(name: str) -> set[str]:
    return set(next(v for v in native_build.X86_64_VARIANTS if v.name == name).cpu_flags)


@pytest.mark.parametrize(
    "flags,want",
    [
        (set(), None),
        (_flags_of("generic"), "generic"),
        (_flags_of("avx2"), "avx2"),
        (_flags_of("avx512") | {"avx512_bf16"}, "avx512bf16"),
        (_flags_of("amx"), "amx"),
        (_flags_of("amx") - {"amx_tile"}, "avx512bf16"),
    ],
)
def test_selection_takes_the_best_variant_the_cpu_executes(flags, want):
    chosen = KernelBackends(KernelConfig(), _platform(flags)).native_variant()
    assert (chosen.name if chosen else None) == want


def test_selection_honours_a_forced_variant_and_refuses_what_cannot_run(tmp_path):
    b = KernelBackends(KernelConfig(isa="generic", cache_dir=tmp_path), _platform(_flags_of("amx")))
    assert b.native_variant().name == "generic"
    weak = KernelBackends(KernelConfig(cache_dir=tmp_path), _platform(_flags_of("avx2")))
    with pytest.raises(ValueError, match=r"needs CPU flags \['avx512_bf16'"):
        weak.load(native_build.X86_64_VARIANTS[3])
    other = KernelBackends(KernelConfig(), _platform(set(), machine="aarch64"))
    assert other.native_variant() == native_build.BASELINE_VARIANT


def test_kernel_config_from_env_and_validation(tmp_path):
    env = {"TANDEM_CPU_KERNELS": "0", "TANDEM_CACHE_DIR": str(tmp_path), "CC": "clang"}
    config = KernelConfig.from_env(env | {"TANDEM_CPU_ISA": "avx2"})
    assert config == KernelConfig(
        cpu_native=False, cache_dir=tmp_path / "kernels", compiler="clang", isa="avx2"
    )
    assert KernelConfig.from_env({}) == KernelConfig()
    with pytest.raises(ValueError, match="isa must be one of"):
        KernelConfig(isa="avx1024")


def test_disabled_native_kernels_put_cpu_tensors_on_torch(tmp_path):
    off = KernelBackends(KernelConfig(cpu_native=False, cache_dir=tmp_path), Platform.detect())
    assert off.native() is None
    assert off.for_tensor(torch.zeros(1)) is KernelBackend.TORCH
    assert not list(Path(tmp_path).glob("*"))


def test_selected_restores_the_previous_selection():
    before = backend.current()
    with on_variant(backend.current().platform.variants[0].name) as lib:
        assert backend.current().native() is lib
        assert backend.current().for_tensor(torch.zeros(1)) is KernelBackend.CPU_NATIVE
    assert backend.current() is before


def test_cli_configures_kernels_for_model_commands_only(monkeypatch, tmp_path):
    """The environment is read at the edge: ``tandem decode`` (a model command) builds
    the KernelConfig from it; ``tandem router`` leaves the kernels alone."""
    from tandem import cli

    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    before = backend.current()
    with backend.selected(before):
        cli.configure_kernels("router")
        assert backend.current() is before
        cli.configure_kernels("decode")
        configured = backend.current()
        assert configured.config == KernelConfig(cpu_native=False, cache_dir=tmp_path / "kernels")
        assert configured.for_tensor(torch.zeros(1)) is KernelBackend.TORCH
    assert backend.current() is before
