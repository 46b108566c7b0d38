"""The native kernels' interface, read from ``csrc/tandem_kernels.h``.

That header is the one declaration source of the bindings: the kernel sources
include it (so the compiler rejects a definition that disagrees with it) and
``parse_header`` turns it into the ctypes prototypes and structs used here (so
Python cannot pass another argument list). ``NativeLibrary`` binds one built
variant of the library (``kernels/native_build.py``) to those prototypes; each
bound function checks its argument count, which ctypes itself does not do for
surplus arguments.

The parser reads a small subset of C, stated at the top of the header; anything
else in it is a ``ValueError`` at import, not a binding that silently differs.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HEADER = Path(__file__).parent / "csrc" / "tandem_kernels.h"

_SCALARS: dict[str, type[ctypes._SimpleCData]] = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "float": ctypes.c_float,
}
_POINTEE = {"void", "uint16_t", "int64_t", "float", "int"}
_DECL = re.compile(r"^(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)$")
_PROTO = re.compile(r"^(\w+)\s+(\w+)\s*\((.*)\)$", re.DOTALL)


@dataclass(frozen=True)
class CParam:
    """A parameter or struct field: its name, base type and whether it is a pointer."""

    name: str
    base: str
    pointer: bool


@dataclass(frozen=True)
class Prototype:
    """One exported function: ``restype`` is ``"int"`` or ``"void"``."""

    name: str
    restype: str
    params: tuple[CParam, ...]


@dataclass(frozen=True)
class Abi:
    """What the header declares: integer constants, structs and prototypes, in order."""

    constants: dict[str, int]
    structs: dict[str, tuple[CParam, ...]]
    prototypes: dict[str, Prototype]


def _param(text: str, structs: dict[str, tuple[CParam, ...]], where: str) -> CParam:
    m = _DECL.match(" ".join(text.split()))
    if m is None:
        raise ValueError(f"{where}: cannot read declaration {text.strip()!r}")
    base, star, name = m.groups()
    pointer = bool(star)
    if pointer and base not in _POINTEE and base not in structs:
        raise ValueError(f"{where}: pointer to unknown type {base!r} in {text.strip()!r}")
    if not pointer and base not in _SCALARS:
        raise ValueError(f"{where}: unsupported scalar type {base!r} in {text.strip()!r}")
    return CParam(name, base, pointer)


def parse_header(text: str) -> Abi:
    """Read the declarations of ``tandem_kernels.h`` (see its opening comment).

    Raises:
        ValueError: naming the declaration that falls outside the subset the
            header promises (an unknown type, a malformed prototype).
    """
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    constants: dict[str, int] = {}
    body_lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            m = re.match(r"#define\s+(TANDEM_\w+)\s+(-?\d+)\s*$", stripped)
            if m:
                constants[m.group(1)] = int(m.group(2))
            continue
        body_lines.append(line)
    body = "\n".join(body_lines)
    structs: dict[str, tuple[CParam, ...]] = {}
    for m in re.finditer(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", body, flags=re.DOTALL):
        fields: list[CParam] = []
        name = m.group(2)
        for decl in filter(str.strip, m.group(1).split(";")):
            # "const uint16_t *a, *b" declares two fields of one base type
            first, *rest = decl.split(",")
            head = _param(first, structs, f"struct {name}")
            fields.append(head)
            prefix = first[: first.rindex(head.name)].replace("*", "")
            fields.extend(_param(prefix + r, structs, f"struct {name}") for r in rest)
        structs[name] = tuple(fields)
    body = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", body, flags=re.DOTALL)
    prototypes: dict[str, Prototype] = {}
    for decl in filter(str.strip, body.split(";")):
        m = _PROTO.match(" ".join(decl.split()))
        if m is None or m.group(1) not in ("int", "void"):
            raise ValueError(f"cannot read prototype {' '.join(decl.split())!r}")
        restype, name, args = m.groups()
        params = (
            ()
            if args.strip() in ("", "void")
            else tuple(_param(a, structs, name) for a in args.split(","))
        )
        prototypes[name] = Prototype(name, restype, params)
    return Abi(constants, structs, prototypes)


ABI = parse_header(HEADER.read_text(encoding="utf-8"))


@functools.cache
def struct(name: str) -> type[ctypes.Structure]:
    """The ctypes ``Structure`` of the header's ``typedef struct {...} name``.

    Raises:
        KeyError: when the header declares no such struct.
    """
    fields = [
        (f.name, ctypes.c_void_p if f.pointer else _SCALARS[f.base]) for f in ABI.structs[name]
    ]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def _ctype(p: CParam) -> type[ctypes._CData]:
    if not p.pointer:
        return _SCALARS[p.base]
    if p.base in ABI.structs:
        return ctypes.POINTER(struct(p.base))
    return ctypes.c_void_p


def _bind(cdll: ctypes.CDLL, proto: Prototype) -> Callable[..., int | None]:
    fn = getattr(cdll, proto.name)
    fn.argtypes = [_ctype(p) for p in proto.params]
    fn.restype = ctypes.c_int if proto.restype == "int" else None
    nargs = len(proto.params)

    def call(*args: object) -> int | None:
        if len(args) != nargs:
            names = ", ".join(p.name for p in proto.params)
            raise TypeError(f"{proto.name}({names}) takes {nargs} arguments, got {len(args)}")
        return fn(*args)

    call.__name__ = proto.name
    return call


class NativeLibrary:
    """One built variant of the kernel library, its functions bound from the header.

    Each prototype of ``tandem_kernels.h`` is an attribute of the same name that
    takes exactly the declared arguments (``TypeError`` otherwise).

    Args:
        path: the shared library (from ``native_build.build_variant``).
        variant: the name of the ISA variant it was built for.

    Raises:
        OSError: when the library cannot be loaded.
        AttributeError: when it lacks a function the header declares.
    """

    def __init__(self, path: Path, variant: str) -> None:
        self.path = path
        self.variant = variant
        self._cdll = ctypes.CDLL(str(path))
        for proto in ABI.prototypes.values():
            setattr(self, proto.name, _bind(self._cdll, proto))

    def __repr__(self) -> str:
        return f"NativeLibrary({self.variant!r}, {str(self.path)!r})"

    def __getattr__(self, name: str) -> Callable[..., int]:
        # only reached for names the header does not declare
        raise AttributeError(f"tandem_kernels.h declares no function {name!r}")

    @functools.cached_property
    def tiles_available(self) -> bool:
        """Whether this build has the AMX tile paths and Linux granted this process
        the tile state (asked once per library)."""
        if not self.amx_available():
            return False
        if self.amx_init() != 0:
            logger.info("Linux refused the AMX tile state: the bf16 kernels use AVX512-BF16")
            return False
        return True
