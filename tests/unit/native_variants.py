"""Kernel tests on every native ISA variant this CPU can execute.

``on_variant(name)`` builds (cached) and loads one variant of the kernel library
and makes it the process's selection for the block; a variant the CPU cannot
execute, or a machine without a C compiler, is a skip that says why. A variant
that fails to compile is an error, not a skip.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import pytest

from tandem.kernels import backend, native_build
from tandem.kernels.native_abi import NativeLibrary

VARIANTS = [v.name for v in backend.current().platform.variants]


@functools.cache
def _load(name: str) -> NativeLibrary:
    b = backend.current()
    return b.load(next(v for v in b.platform.variants if v.name == name))


@contextlib.contextmanager
def on_variant(name: str) -> Iterator[NativeLibrary]:
    """Run the block on variant ``name`` (skips where the CPU cannot execute it)."""
    b = backend.current()
    variant = next(v for v in b.platform.variants if v.name == name)
    missing = variant.missing_flags(b.platform.cpu_flags)
    if missing:
        pytest.skip(f"this CPU cannot execute the {name} variant (no {', '.join(missing)})")
    if native_build.find_compiler(b.config.compiler) is None:
        pytest.skip("no C compiler here: the native CPU kernels cannot be built")
    lib = _load(name)
    with backend.selected(backend.with_native(lib)):
        yield lib
