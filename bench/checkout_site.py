"""A folder in which ``tandem`` imports from this checkout, without pip.

    python -P bench/checkout_site.py SITE
    PYTHONPATH=SITE python -P -m tandem.bench.gpu_check

On a machine with no package registry (a lent GPU box) nothing can be installed, and the
repository root must not go on ``sys.path`` either: its ``kernels/`` folder would shadow
Hugging Face's ``kernels`` distribution, which transformers imports. ``SITE`` then holds a
single package, ``tandem``: a folder of links to each entry of the checkout's ``tandem/``
plus, where pyproject.toml maps folders onto the namespace (``[tool.setuptools.package-dir]``,
e.g. ``"tandem.engine" = "engine"``), a link per mapped top-level subpackage. Nested
mappings must follow the folder tree (``tandem.engine.models`` = ``engine/models``), which
the link of their parent then covers.

This script imports nothing from tandem (it runs before ``tandem`` is importable) and only
the standard library; it runs on Python 3.10 (no ``tomllib``), hence the small reader of
that one table.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ENTRY = re.compile(r'^\s*"([^"]+)"\s*=\s*"([^"]+)"\s*(#.*)?$')


def package_dirs(pyproject: str) -> dict[str, str]:
    """The ``[tool.setuptools.package-dir]`` table of ``pyproject`` (its text): package
    name to folder, relative to the checkout; empty when the table is absent.

    Raises:
        ValueError: a line of the table is not ``"name" = "folder"``.
    """
    found: dict[str, str] = {}
    inside = False
    for raw in pyproject.splitlines():
        line = raw.strip()
        if line.startswith("["):
            inside = line == "[tool.setuptools.package-dir]"
            continue
        if not inside or not line or line.startswith("#"):
            continue
        m = _ENTRY.match(line)
        if m is None:
            raise ValueError(f"pyproject.toml [tool.setuptools.package-dir]: cannot read {raw!r}")
        found[m.group(1)] = m.group(2)
    return found


def site_links(root: Path, mapping: dict[str, str]) -> dict[str, Path]:
    """The links the site's ``tandem/`` folder holds: name to the path it points to.

    Raises:
        ValueError: a nested package is mapped to a folder other than its parent's
            folder plus its own name (one link per top-level subpackage could not
            serve it), or a mapping and an entry of ``tandem/`` name the same thing
            differently.
    """
    links = {p.name: p for p in sorted((root / "tandem").iterdir()) if p.name != "__pycache__"}
    for name, folder in sorted(mapping.items()):
        parts = name.split(".")
        if parts[0] != "tandem" or len(parts) == 1:
            continue
        if len(parts) > 2:
            parent = mapping.get(".".join(parts[:-1]))
            if parent is None or Path(folder) != Path(parent) / parts[-1]:
                raise ValueError(f"{name} maps to {folder}, not under its parent's folder")
            continue
        target = root / folder
        have = links.get(parts[1])
        if have is not None and have.resolve() != target.resolve():
            raise ValueError(f"tandem/{parts[1]} is {have}, but pyproject maps it to {folder}")
        links[parts[1]] = target
    return links


def build_site(site: Path, root: Path = ROOT) -> Path:
    """(Re)write ``site/tandem`` as links into ``root``; returns ``site``. Links left by an
    earlier run are replaced, so the site follows the checkout's current layout."""
    mapping = package_dirs((root / "pyproject.toml").read_text())
    links = site_links(root, mapping)
    pkg = site / "tandem"
    pkg.mkdir(parents=True, exist_ok=True)
    for old in pkg.iterdir():
        if old.is_symlink() or old.is_file():
            old.unlink()
    for name, target in links.items():
        os.symlink(target.resolve(), pkg / name)
    return site


def main(argv: list[str] | None = None) -> int:
    """``checkout_site.py SITE``: build the site folder; prints its path. Returns 0."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -P bench/checkout_site.py SITE", file=sys.stderr)
        return 2
    print(build_site(Path(args[0]).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
