"""A new user's first minutes, run the way a user runs them: plain ``python`` (no ``-P``,
no PYTHONSAFEPATH), from the repository root and from an empty folder.

Pins two bugs:
- the repository root on ``sys.path`` (plain ``python -c``, a script or notebook in the
  checkout) made the checkout's ``kernels/`` folder shadow Hugging Face's ``kernels``
  distribution, which transformers imports: ``from tandem import LLM; LLM()`` died with
  "cannot import name 'CUDAProperties' from 'kernels'";
- ``LLM(pipeline_parallel_size=2)`` in a script without ``if __name__ == "__main__":``
  failed with multiprocessing's "bootstrapping phase" error from inside a worker, with no
  word from tandem on what to do.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _plain_env() -> dict[str, str]:
    """The environment of a user's shell: without the suite's PYTHONSAFEPATH or PYTHONPATH."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}


def _readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _offline_example() -> str:
    """The README's Python API examples (offline engine, then streaming through the
    lower-level engine, which reuses ``llm``), as one script, output shortened."""
    blocks = [b for b in _readme_python_blocks() if "tandem import LLM" in b or "llm_engine" in b]
    assert len(blocks) == 2, "README: expected the offline example and the streaming example"
    script = "\n".join(blocks)
    # Fewer tokens than the README asks for keep the run short; the code is the README's.
    return re.sub(r"max_tokens=\d+", "max_tokens=4", script)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_readme_offline_example_runs_with_plain_python(where: str, tmp_path: Path) -> None:
    cwd = ROOT if where == "root" else tmp_path
    script = tmp_path / "example.py"
    script.write_text(_offline_example())
    # `python -c` puts the working directory first on sys.path, as a user's shell does.
    proc = subprocess.run([sys.executable, "-c", script.read_text()], cwd=cwd,
                          env=_plain_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Three finish reasons printed by the first loop (two prompts) and a chat reply.
    assert proc.stdout.count("length") + proc.stdout.count("stop") >= 2, proc.stdout


def test_root_folders_never_shadow_installed_distributions() -> None:
    """From the repository root, with the root first on sys.path: only ``tandem`` is a
    regular package; every other folder is at most an empty namespace portion, and
    Hugging Face's ``kernels`` (a transformers dependency) imports from site-packages."""
    regular = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert regular == ["tandem"], regular
    code = textwrap.dedent("""
        import importlib, importlib.util, json, sys
        names = ["kernels", "engine", "services", "kvstore", "contracts", "bench", "protos",
                 "tests"]
        out = {}
        for n in names:
            spec = importlib.util.find_spec(n)
            out[n] = None if spec is None else spec.origin
        # Hugging Face's `kernels` distribution (a transformers dependency), by its
        # installed name: what the checkout's kernels/ folder must not shadow.
        out["kernels_file"] = importlib.import_module("kernels").__file__
        from transformers.integrations import hub_kernels  # imports `kernels`' API
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_plain_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    found = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels_file = found.pop("kernels_file")
    assert not Path(kernels_file).resolve().is_relative_to(ROOT / "kernels"), kernels_file
    for name, origin in found.items():
        # A module with code (origin set) from the checkout's folder would shadow.
        assert origin is None or not Path(origin).resolve().is_relative_to(ROOT / name), (
            name, origin)


def test_unguarded_parallel_script_fails_at_once_naming_the_fix(tmp_path: Path) -> None:
    script = tmp_path / "pp_unguarded.py"
    script.write_text(textwrap.dedent("""
        from tandem import LLM, SamplingParams

        llm = LLM(pipeline_parallel_size=2)
        print(llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].text)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_plain_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-4000:]
    assert f"line 4 of {script}" in proc.stderr, proc.stderr[-4000:]
    # Refused in the parent before any worker re-ran the script.
    assert "bootstrapping phase" not in proc.stderr, proc.stderr[-4000:]
