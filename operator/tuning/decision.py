"""The tuner's memory and verdicts as data: `TunerState` (what `decide` carries from one window to the
next), `Decision` (what it returns), the `Tuned` condition, and the two ways a decision is made: `stay`
and `move` (which also records what the next window must judge)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.actions import HOLD, RAISE_CHUNK, ROLLBACK
from iterserve.operator.tuning.chunk_moves import cheap_raise_base, decodes_cheap
from iterserve.operator.tuning.failures import FailedSetting
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.reading import Reading


@dataclass(frozen=True)
class Condition:
    """The `Tuned` condition: status "True" / "False" / "Unknown", a CamelCase reason and a message."""

    status: str
    reason: str
    message: str


NOT_OBSERVED = Condition("Unknown", "NotObserved", "no window with enough samples yet")


@dataclass(frozen=True)
class PendingChange:
    """A change made by the tuner, waiting for the first window measured entirely after it."""

    before: Knobs
    action: str
    before_healthy: bool  # the SLO was met without preemptions or errors before it
    before_trouble: bool  # there were preemptions or errors before it
    aim: str | None  # the p99 it meant to bring down ("ttft" / "itl"), None for a raise or a safety back-off
    before_ttft: float  # p99 / SLO ratios and throughput before it
    before_itl: float
    before_request_rate: float
    before_prompt_token_rate: float


@dataclass(frozen=True)
class TunerState:
    knobs: Knobs  # in force on the pods
    last_good: Knobs | None = None  # rollback point: the last setting that met the SLO without trouble
    last_change_time: float | None = None
    # the settings the last few changes left (oldest first), and the move that made the latest change
    recent_knobs: tuple[Knobs, ...] = ()
    previous_action: str | None = None
    pending: PendingChange | None = None
    failed: tuple[FailedSetting, ...] = ()
    # the chunk in force before the raises made while decodes were absent or cheap (`raise_chunk_for_prefill`,
    # or a TTFT cure with p99 ITL under half the headroom line), put back as soon as decodes breach ITL
    # (`chunk_back_for_decodes`); None: no such raise stands
    chunk_before_cheap_raise: int | None = None
    # recent windows in which p99 TTFT (ITL) was over its SLO, counting only windows that do not overlap
    # the last one counted, and the end of that one
    num_ttft_breaches: int = 0
    num_itl_breaches: int = 0
    ttft_breach_end: float | None = None
    itl_breach_end: float | None = None
    tuned: Condition = NOT_OBSERVED

    def blocked_until(self, knobs: Knobs, now: float, mix: float | None = None,
                      mix_factor: float = math.inf) -> float | None:
        """When `knobs` may be tried again under a load of `mix` (None: now)."""
        return max((f.until for f in self.failed if f.blocks(knobs, now, mix, mix_factor)), default=None)


@dataclass(frozen=True)
class Decision:
    action: str
    reason: str
    time: float
    knobs: Knobs | None  # the setting to move to (applied in auto mode, recommended in observe); None: stay
    applied: bool  # True when the caller must apply `knobs` now (auto mode)
    slo_met: bool | None  # None when the window decided nothing
    tuned: Condition
    state: TunerState  # the state after this decision


RECENT_MOVES = 3  # how many settings back a move counts as returning (see corrections.remember_move)


def stay(state: TunerState, now: float, reason: str, met: bool | None, tuned: Condition) -> Decision:
    return Decision(HOLD, reason, now, None, False, met, tuned, dataclasses.replace(state, tuned=tuned))


def move(s: TunerState, policy: TuningPolicy, now: float, action: str, target: Knobs, reason: str,
         r: Reading | None, tuned: Condition, aim: str | None = None) -> Decision:
    """A change: applied in auto mode (the next window judges it), only recommended in observe mode."""
    met = None if r is None else r.met
    if policy.mode != "auto":
        return Decision(action, f"recommended: {reason}", now, target, False, met, tuned,
                        dataclasses.replace(s, tuned=tuned))
    pending = None
    if r is not None and action != ROLLBACK:
        pending = PendingChange(s.knobs, action, r.met and r.trouble is None, r.trouble is not None, aim, r.ttft,
                                r.itl, r.obs_request_rate, r.obs_prompt_token_rate)
    nxt = dataclasses.replace(s, knobs=target, last_change_time=now, pending=pending, tuned=tuned,
                              recent_knobs=(*s.recent_knobs, s.knobs)[-RECENT_MOVES:], previous_action=action,
                              chunk_before_cheap_raise=cheap_raise_base(
                                  s.chunk_before_cheap_raise, _raise_row_start(s), target,
                                  action == RAISE_CHUNK and r is not None and decodes_cheap(r, policy)))
    return Decision(action, reason, now, target, True, met, tuned, nxt)


def breached(r: Reading, previous: Condition) -> Condition:
    """SLOBreached while correcting; once no setting was found to meet the SLO, that verdict stands through
    the later probes until the SLO is met again, so the condition does not flap with each retry."""
    text = r.trouble + "; " + r.text if r.trouble else r.text
    if previous.status == "False" and previous.reason in ("NoBetterSetting", "BoundsReached"):
        return Condition("False", previous.reason, f"{text}; trying another setting")
    return Condition("False", "SLOBreached", text)


def _raise_row_start(s: TunerState) -> Knobs:
    """The setting before the chunk raise that made the current setting, if the last change was one, else
    the current setting. A raise made while decodes were absent or cheap right after a TTFT cure serves
    the same documents as that cure, which the decodes left from the last phase (near their SLO) paid for,
    so `chunk_back_for_decodes` puts back the chunk before both (docs/tuning.md)."""
    if s.previous_action == RAISE_CHUNK and s.recent_knobs \
            and s.recent_knobs[-1].prefill_chunk_size < s.knobs.prefill_chunk_size:
        return s.recent_knobs[-1]
    return s.knobs
