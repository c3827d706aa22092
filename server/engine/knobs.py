"""The scheduler's live knobs: changed from any thread, read once per step by the scheduler.

A change replaces the whole frozen value (`Knobs`, common/wire.py, which the operator's tuner uses too),
so the scheduler sees either the old set or the new one, never half of a change. It takes effect at the
next step; nothing running is evicted.
"""

from __future__ import annotations

import threading

from iterserve.common.wire import KnobError, Knobs
from iterserve.server.errors import InvalidRequestError


def make_knobs(**values: int) -> Knobs:
    """Knobs from the server's flags or config, or InvalidRequestError naming the first bad one."""
    try:
        return Knobs(**values)
    except KnobError as e:
        raise InvalidRequestError(e.param, e.message) from None


def validate_change(current: Knobs, changes: dict[str, int]) -> Knobs:
    """The knobs after `changes`, or InvalidRequestError naming the first bad field; nothing applied."""
    try:
        return current.replace(**changes)
    except KnobError as e:
        raise InvalidRequestError(e.param, e.message) from None


class LiveKnobs:
    """Holds the current Knobs; `update` validates a change as a whole before applying it."""

    def __init__(self, initial: Knobs):
        self._value = initial
        self._lock = threading.Lock()
        self.num_changes = 0

    @property
    def value(self) -> Knobs:
        return self._value

    def update(self, **changes: int) -> Knobs:
        with self._lock:
            new = validate_change(self._value, changes)  # raises before anything changes
            if new != self._value:
                self.num_changes += 1
            self._value = new
            return new
