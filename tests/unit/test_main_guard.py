"""Which top-level lines of a main script "spawn" would re-run in every worker
(engine/executor/main_guard.py): the rule that refuses an unguarded ``LLM(pp=2)``."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.engine.executor.main_guard import _guarded

SCRIPT = textwrap.dedent("""\
    import os
    llm = make()
    if __name__ == "__main__":
        llm = make()
        try:
            llm = make()
        finally:
            pass
    if "__main__" == __name__:
        main()
    if os.environ.get("X"):
        llm = make()
        if __name__ == "__main__":
            llm = make()
    def main():
        return make()
""")


@pytest.mark.parametrize(("line", "guarded"), [
    (2, False),   # top level
    (4, True),    # under the guard
    (6, True),    # in a try under the guard
    (10, True),   # guard with the operands swapped
    (12, False),  # under another if
    (14, True),   # a guard nested in another if
    (16, False),  # a def body: not guarded itself; where main() is called decides
])
def test_guarded_lines(line: int, guarded: bool) -> None:
    assert _guarded(ast.parse(SCRIPT).body, line) is guarded


@pytest.mark.parametrize(("body", "refused"), [
    ("check()", True),
    ("if __name__ == '__main__':\n    check()", False),
    ("def main():\n    check()\nif __name__ == '__main__':\n    main()", False),
    ("def main():\n    check()\nmain()", True),
])
def test_check_main_guard_in_a_script(tmp_path: Path, body: str, refused: bool) -> None:
    """The check walks up from the engine to the script's own top-level line."""
    script = tmp_path / "user_script.py"
    script.write_text("from tandem.engine.executor.main_guard import check_main_guard as check\n"
                      + body + "\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert (proc.returncode != 0) is refused, proc.stderr
    if refused:
        assert 'if __name__ == "__main__":' in proc.stderr


def test_python_c_is_never_refused() -> None:
    """``python -c`` has no main script for "spawn" to re-run."""
    code = "from tandem.engine.executor.main_guard import check_main_guard; check_main_guard()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
