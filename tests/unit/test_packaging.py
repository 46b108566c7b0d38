"""The whole tree imports under `tandem`; the card's folders are not top-level names."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def test_namespace_maps_card_folders() -> None:
    import tandem.engine
    import tandem.kernels
    import tandem.kvstore

    assert tandem.engine.__file__.endswith("engine/__init__.py")
    assert tandem.kernels.__file__.endswith("kernels/__init__.py")
    assert tandem.kvstore.__file__.endswith("kvstore/__init__.py")


def test_card_folders_not_importable_top_level(tmp_path) -> None:
    # Run from a neutral directory: only installed packages are visible there.
    code = (
        "import importlib.util, sys;"
        "names=['kernels','engine','services','kvstore'];"
        "sys.exit(1 if any(importlib.util.find_spec(n) for n in names) else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path)
    assert proc.returncode == 0, "a card folder is importable as a top-level package"


def test_cli_lists_commands() -> None:
    from tandem.cli import main

    assert main(["--help"]) == 0
    assert main(["no-such-command"]) == 2
    assert importlib.util.find_spec("tandem.cli") is not None
