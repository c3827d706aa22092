"""The scheduler's live knobs: changed from any thread, read once per step by the scheduler.

A change replaces the whole frozen value, so the scheduler sees either the old set or the new one,
never half of a change. It takes effect at the next step; nothing running is evicted.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from iterserve.common import wire
from iterserve.server.errors import InvalidRequestError


@dataclass(frozen=True)
class SchedulerKnobs:
    # defaults and meanings: common/wire.py, which the operator reads too
    max_num_seqs: int = wire.KNOB_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = wire.KNOB_DEFAULTS["max_num_batched_tokens"]
    prefill_chunk_size: int = wire.KNOB_DEFAULTS["prefill_chunk_size"]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f.name, f"must be an integer >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def validate_change(current: SchedulerKnobs, changes: dict[str, int]) -> SchedulerKnobs:
    """The knobs after `changes`, or InvalidRequestError naming the first bad field; nothing applied."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(SchedulerKnobs)}
    if unknown:
        raise InvalidRequestError(sorted(unknown)[0], "unknown scheduler knob")
    return dataclasses.replace(current, **changes)  # validates


class LiveKnobs:
    """Holds the current SchedulerKnobs; `update` validates a change as a whole before applying it."""

    def __init__(self, initial: SchedulerKnobs):
        self._value = initial
        self._lock = threading.Lock()
        self.num_changes = 0

    @property
    def value(self) -> SchedulerKnobs:
        return self._value

    def update(self, **changes: int) -> SchedulerKnobs:
        with self._lock:
            new = validate_change(self._value, changes)  # raises before anything changes
            if new != self._value:
                self.num_changes += 1
            self._value = new
            return new
