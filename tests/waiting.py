"""The tests' one way to wait: poll a condition until it holds or a deadline passes.

Tests never sleep to synchronise; where there is no event to wait on (a process
becoming healthy, a heartbeat expiring), they poll the observable condition with
a deadline, and the poll interval is only how often it is checked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T],
    timeout_s: float,
    what: str = "condition",
    interval_s: float = 0.05,
    error: type[Exception] = TimeoutError,
) -> T:
    """Call ``cond`` until it returns a truthy value, and return that value.

    ``cond`` may raise to abort the wait (e.g. the process it waits on died).

    Raises:
        ``error`` (TimeoutError by default) naming ``what`` once ``timeout_s``
        seconds passed without a truthy value.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
