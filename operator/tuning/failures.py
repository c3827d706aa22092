"""The tuner's memory of settings that made things worse: `FailedSetting`, what it blocks and for how long.

A failure blocks its setting (and the settings beyond it along the knob it turned) for `retry_after_s`,
doubling each time the same knob fails the same way under a like load; and only under a like load, judged
by prompt tokens per request (`same_mix`): what failed for short chats may be the cure for long documents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.actions import DIRECTIONS
from iterserve.operator.tuning.policy import TuningPolicy


@dataclass(frozen=True)
class FailedSetting:
    """A setting that made things worse; until `until` it blocks itself and, when `knob` is set, every
    setting further along that knob in `direction` (+1: that many or more, -1: that few or fewer) with the
    other knobs equal, so a raise that breached once is not approached again step by step. It blocks only
    under a load like the one it failed under (`mix`: prompt tokens per request then, None: unknown)."""

    knobs: Knobs
    until: float
    num_failures: int
    knob: str | None = None
    direction: int = 0
    mix: float | None = None

    def covers(self, target: Knobs) -> bool:
        if target == self.knobs:
            return True
        if self.knob is None or target.replace(**{self.knob: getattr(self.knobs, self.knob)}) != self.knobs:
            return False
        return self.direction * (getattr(target, self.knob) - getattr(self.knobs, self.knob)) >= 0

    def blocks(self, target: Knobs, now: float, mix: float | None, mix_factor: float) -> bool:
        return now < self.until and self.covers(target) and same_mix(self.mix, mix, mix_factor)

    def on_line_with(self, other: FailedSetting) -> bool:
        """Both failed the same way along the same knob, the other knobs equal."""
        return (self.knob is not None and self.knob == other.knob and self.direction == other.direction
                and (self.covers(other.knobs) or other.covers(self.knobs)))


def same_mix(a: float | None, b: float | None, factor: float) -> bool:
    """Two loads alike: prompt tokens per request within `factor` of each other (alike when unknown)."""
    if a is None or b is None:
        return True
    low, high = sorted((a, b))
    return high <= factor * max(low, 1.0)


def remember_failure(failed: tuple[FailedSetting, ...], entry: FailedSetting, now: float,
                     policy: TuningPolicy) -> tuple[FailedSetting, ...]:
    """Add `entry` (its `until` and `num_failures` set here). Failures along the same knob and direction
    (the other knobs equal) under a like load compound: each waits twice as long as the last, and the new
    one replaces those it covers. A failure under another load is kept beside it: each load has its own."""
    alike = [f for f in failed if same_mix(f.mix, entry.mix, policy.mix_factor)]
    related = [f for f in alike if f.knobs == entry.knobs or entry.on_line_with(f)]
    n = max((f.num_failures for f in related), default=0) + 1
    entry = dataclasses.replace(entry, until=now + policy.retry_after_s * 2 ** (n - 1), num_failures=n)
    replaced = [f for f in alike if f.knobs == entry.knobs or entry.covers(f.knobs)]
    return tuple(f for f in failed if f not in replaced) + (entry,)


def mark_failed(failed: tuple[FailedSetting, ...], knobs: Knobs, now: float, policy: TuningPolicy,
                action: str, mix: float | None) -> tuple[FailedSetting, ...]:
    """Add `knobs` as failed by `action` under a load of `mix`, blocking the settings beyond it that way."""
    knob, direction = DIRECTIONS.get(action, (None, 0))
    return remember_failure(failed, FailedSetting(knobs, 0.0, 0, knob, direction, mix), now, policy)
