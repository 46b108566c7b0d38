"""Fail at once when worker processes would re-run an unguarded script.

The "mp" executor starts its workers with multiprocessing's "spawn" method, which runs
the parent's main script again in every worker (as ``__mp_main__``) before the worker's
own code. A script that builds ``LLM(tensor_parallel_size=2)`` at its top level, outside
``if __name__ == "__main__":``, would build it again in each worker; multiprocessing
then stops the nested start with "An attempt has been made to start a new process before
the current process has finished its bootstrapping phase", and the engine only sees a
worker that died. vLLM documents the same rule (its "Python multiprocessing" page); here
the parent finds the unguarded call before spawning anything and says what to change.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType

__all__ = ["UNGUARDED_MAIN_HINT", "check_main_guard", "unguarded_main_line"]

UNGUARDED_MAIN_HINT = (
    "worker processes (tensor_parallel_size or pipeline_parallel_size > 1) are started "
    "with multiprocessing's 'spawn' method, which runs your main script again in every "
    "worker; line {line} of {path} runs at the script's top level, so each worker would "
    "build the engine again. Put the code that builds the LLM under "
    "`if __name__ == \"__main__\":` (or in a function called from there)."
)


def _main_script() -> Path | None:
    """The file that "spawn" re-runs in each worker: ``__main__``'s source file when the
    program was started from one (``python script.py`` or ``python -m package.module``);
    None for ``python -c``, the REPL and notebooks, where nothing is re-run."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(spec, "origin", None) if spec is not None else getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return None
    file = Path(path)
    return file if file.is_file() else None


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    operands = [test.left, test.comparators[0]]
    names = [o for o in operands if isinstance(o, ast.Name) and o.id == "__name__"]
    consts = [o for o in operands if isinstance(o, ast.Constant) and o.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def _guarded(body: list[ast.stmt], line: int) -> bool | None:
    """Whether ``line`` of a module lies under a main guard: True or False for a line in
    ``body``'s statements, None when no statement of ``body`` holds it."""
    for node in body:
        end = node.end_lineno if node.end_lineno is not None else node.lineno
        if not node.lineno <= line <= end:
            continue
        if _is_main_guard(node):
            return True
        if isinstance(node, ast.If | ast.Try | ast.With | ast.For | ast.While):
            for inner in _nested_bodies(node):
                found = _guarded(inner, line)
                if found is not None:
                    return found
        return False
    return None


def _nested_bodies(node: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement (its body, else, handlers...)."""
    out: list[list[ast.stmt]] = []
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if value:
            out.append(value)
    for handler in getattr(node, "handlers", []) or []:
        out.append(handler.body)
    return out


def unguarded_main_line(frame: FrameType | None = None) -> tuple[Path, int] | None:
    """Where the running main script reaches the caller from its top level outside a main
    guard: ``(script path, line)``, or None when "spawn" would not re-run that code (no
    main script, the call comes from under ``if __name__ == "__main__":`` or from code the
    script does not run at its top level, or the source cannot be read).

    ``frame`` is where to start walking up the stack (default: the caller's frame).
    """
    script = _main_script()
    if script is None:
        return None
    main = sys.modules.get("__main__")
    frame = frame if frame is not None else sys._getframe(1)
    # NOTE: the main script's top-level frame runs a "<module>" code object over __main__'s
    # dict (its functions share that dict); its current line is the statement that led here.
    main_dict = getattr(main, "__dict__", None)
    while frame is not None and not (frame.f_globals is main_dict
                                     and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    line = frame.f_lineno
    if _guarded(tree.body, line) is False:
        return script, line
    return None


def check_main_guard() -> None:
    """Raise before any worker is spawned when "spawn" would re-run the engine's creation.

    Raises:
        RuntimeError: the main script builds the engine at its top level outside
            ``if __name__ == "__main__":``; the message names the file, the line and the fix.
    """
    found = unguarded_main_line(sys._getframe(1))
    if found is not None:
        path, line = found
        raise RuntimeError(UNGUARDED_MAIN_HINT.format(line=line, path=path))
