"""The whole tree imports under `tandem`; the card's folders are not top-level names."""

from __future__ import annotations

import importlib.util
import os
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


def test_native_kernel_sources_are_package_data() -> None:
    """Every C source and header the CPU kernels build from ships in the wheel
    (package-data), and the build hashes every header (a stale cached build
    would otherwise survive a header change)."""
    import fnmatch
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["tandem.kernels"]
    csrc = root / "kernels" / "csrc"
    sources = sorted(p.relative_to(root / "kernels").as_posix() for p in csrc.glob("*.c"))
    headers = sorted(p.relative_to(root / "kernels").as_posix() for p in csrc.glob("*.h"))
    assert sources, "no kernel sources found"
    for src in sources + headers:
        assert any(fnmatch.fnmatch(src, pat) for pat in patterns), src
    from tandem.kernels import native_build

    assert {name for name, _ in native_build.SOURCES} == {Path(s).name for s in sources}
    assert set(native_build.HEADERS) == {Path(h).name for h in headers}


def test_openmp_defaults_only_for_service_commands() -> None:
    """``import tandem`` (the offline API) leaves libgomp's defaults alone; a
    service command sets a short spin then sleep, unless the user set values."""
    from tandem import cli

    code = "import os, tandem; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["None", "None"], out.stderr
    saved = {k: os.environ.pop(k, None) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    try:
        cli.configure_openmp("bench")
        assert "GOMP_SPINCOUNT" not in os.environ
        cli.configure_openmp("serve")
        assert (os.environ["OMP_WAIT_POLICY"], os.environ["GOMP_SPINCOUNT"]) == ("PASSIVE", "10000")
        os.environ["GOMP_SPINCOUNT"] = "5"
        cli.configure_openmp("decode")
        assert os.environ["GOMP_SPINCOUNT"] == "5"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
