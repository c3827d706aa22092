"""One way for tests to wait for something: poll a predicate until it holds or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable, *, timeout: float, what: str = "the condition", interval: float = 0.2,
               fail_if: Callable[[], str | None] | None = None):
    """Poll `predicate` until it returns something truthy, and return that. TimeoutError names `what`;
    `fail_if` is asked before each poll and stops the wait with its message (a process that exited)."""
    deadline = time.monotonic() + timeout
    while True:
        if fail_if is not None and (why := fail_if()):
            raise RuntimeError(f"while waiting for {what}: {why}")
        if result := predicate():
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
