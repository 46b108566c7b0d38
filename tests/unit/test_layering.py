"""The layering of the tree, checked from the source: which part may import which.

Rules (docs/architecture.md, "Layering"):
- engine imports no kvstore and no services;
- kernels import no engine, kvstore or services;
- kvstore imports no services;
- contracts import no engine internals but its value types, no kernels/kvstore/services, no torch;
- services/prefill and services/decode do not import each other; services/common imports neither;
- the router imports no torch, kernels or models, directly or through anything it imports.

Every ``import`` statement counts, at module level or inside a function: a lazy import is
still a dependency (an ``if TYPE_CHECKING:`` block is not). The router's rule is checked on the import closure of its modules within
the tree, so a helper that pulls torch in through another module is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: folder -> package it is imported as (the links under tandem/, pyproject's packages).
PACKAGES = {
    "tandem": "tandem",
    "contracts": "tandem.contracts",
    "engine": "tandem.engine",
    "kernels": "tandem.kernels",
    "kvstore": "tandem.kvstore",
    "services": "tandem.services",
    "bench": "tandem.bench",
    "protos/tandem/v1": "tandem.v1",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for folder, package in sorted(PACKAGES.items(), key=lambda kv: -len(kv[0])):
        try:
            inner = rel.relative_to(folder)
        except ValueError:
            continue
        parts = list(inner.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([package, *parts])
    raise AssertionError(f"{rel} is outside the mapped packages")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST, top_level_only: bool) -> list[ast.AST]:
    """The statements that can run: ``if TYPE_CHECKING:`` bodies are for the type checker
    only; with ``top_level_only``, function and class bodies are left out too."""
    out: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if _is_type_checking(node):
            todo.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        out.append(node)
        if top_level_only and isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
        ):
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(module: str, *, top_level_only: bool = False) -> set[str]:
    """Every module name ``module`` imports (absolute, relative ones resolved); with
    ``top_level_only``, only what runs when the module is imported (not in functions)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _runtime_nodes(tree, top_level_only):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            # `from pkg import sub` may name a submodule.
            names.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in MODULES)
    return names


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(part: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    out = []
    for module in sorted(MODULES):
        if not _within(module, part):
            continue
        for name in sorted(_imports(module)):
            if any(_within(name, f) for f in forbidden) and not any(
                _within(name, a) for a in allowed
            ):
                out.append(f"{module} imports {name}")
    return out


@pytest.mark.parametrize(
    ("part", "forbidden", "allowed"),
    [
        ("tandem.engine", ("tandem.kvstore", "tandem.services"), ()),
        ("tandem.kernels", ("tandem.engine", "tandem.kvstore", "tandem.services"), ()),
        ("tandem.kvstore", ("tandem.services",), ()),
        (
            "tandem.contracts",
            ("torch", "tandem.engine", "tandem.kernels", "tandem.kvstore", "tandem.services"),
            ("tandem.engine.sampling_params", "tandem.engine.request"),
        ),
        ("tandem.services.prefill", ("tandem.services.decode",), ()),
        ("tandem.services.decode", ("tandem.services.prefill",), ()),
        ("tandem.services.common", ("tandem.services.prefill", "tandem.services.decode"), ()),
    ],
)
def test_part_imports_only_what_it_may(
    part: str, forbidden: tuple[str, ...], allowed: tuple[str, ...]
) -> None:
    assert _violations(part, forbidden, allowed) == []


def _closure(roots: list[str]) -> dict[str, str]:
    """Every module reachable from ``roots`` by imports -> the module that first imported it.

    A module named in an import counts with every import it holds (a lazy one is still a
    dependency); a package that is only the parent of one (importing ``a.b.c`` runs
    ``a/__init__`` and ``a/b/__init__``) counts with its module-level imports alone: the
    lazy re-exports of ``tandem/__init__``'s ``__getattr__`` run only when asked for.
    """
    seen: dict[str, str] = {r: "" for r in roots}
    todo: list[tuple[str, bool]] = [(r, False) for r in roots]
    done: set[tuple[str, bool]] = set()
    while todo:
        module, parent_only = todo.pop()
        if (module, parent_only) in done:
            continue
        done.add((module, parent_only))
        for name in _imports(module, top_level_only=parent_only):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                seen.setdefault(prefix, module)
                if prefix in MODULES:
                    todo.append((prefix, i < len(parts)))
    return seen


def test_router_never_reaches_torch_kernels_or_models() -> None:
    roots = [m for m in MODULES if _within(m, "tandem.services.router")]
    assert roots, "no router modules found"
    closure = _closure(roots)
    bad = {
        name: via for name, via in closure.items()
        if any(_within(name, f) for f in ("torch", "tandem.kernels", "tandem.engine.models",
                                           "triton"))
    }
    assert bad == {}, f"router reaches (module: imported by) {bad}"


def test_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The scan is not vacuous: a known cross-part import in the tree is found."""
    assert any(_within(n, "tandem.engine") for n in _imports("tandem.services.common.context"))
