"""The tuner's decision, a pure function: `decide(state, observation, policy, now) -> Decision`.

Rules, in order (docs/tuning.md explains each and why):
1. knobs outside the bounds are brought inside at once;
2. a window with too few samples decides nothing; during the cooldown after a change nothing changes
   unless pods preempt or fail;
3. the first window after a change judges it: a change that broke a met SLO (or brought preemptions or
   errors) is rolled back to the last good setting, one that made a breach worse is reverted; either way
   the failed setting is not retried before `retry_after_s` (doubling each time it fails again);
4. preemptions or failed steps back max_num_seqs off multiplicatively;
5. a breach (confirmed over `confirm_breaches` windows unless severe) is diagnosed: ITL over while TTFT
   has headroom lowers prefill_chunk_size (prefill stalls decode); TTFT over while ITL has headroom raises
   max_num_seqs when requests queue, else prefill_chunk_size; anything else backs max_num_seqs off;
6. with both p99s under (1 - headroom) x SLO, KV usage under the pressure threshold and requests waiting,
   max_num_seqs goes up by one step; between headroom and SLO nothing moves (the hysteresis band).
`Tuned` is True while the SLO is met, False with `SLOBreached` while correcting, `BoundsReached` when the
correction needed lies outside the bounds, `NoBetterSetting` when every correction left was tried and made
things worse. In `observe` mode the decision is only a recommendation: the state keeps its knobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from iterserve.operator.tuning.knobs import Knobs
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import KnobBounds, TuningPolicy

HOLD = "hold"
CLAMP = "clamp_to_bounds"
RAISE_SEQS = "raise_max_num_seqs"
BACK_OFF_SEQS = "back_off_max_num_seqs"
LOWER_CHUNK = "lower_prefill_chunk_size"
RAISE_CHUNK = "raise_prefill_chunk_size"
ROLLBACK = "rollback"
ACTIONS = (HOLD, CLAMP, RAISE_SEQS, BACK_OFF_SEQS, LOWER_CHUNK, RAISE_CHUNK, ROLLBACK)


@dataclass(frozen=True)
class Condition:
    """The `Tuned` condition: status "True" / "False" / "Unknown", a CamelCase reason and a message."""

    status: str
    reason: str
    message: str


NOT_OBSERVED = Condition("Unknown", "NotObserved", "no window with enough samples yet")


@dataclass(frozen=True)
class FailedSetting:
    knobs: Knobs
    until: float  # not tried again before this time
    num_failures: int


@dataclass(frozen=True)
class PendingChange:
    """A change made by the tuner, waiting for the first window measured entirely after it."""

    before: Knobs
    before_score: float  # worst p99/SLO ratio measured before the change
    before_met: bool


@dataclass(frozen=True)
class TunerState:
    knobs: Knobs  # in force on the pods
    last_good: Knobs | None = None  # rollback point: the last setting that met the SLO without trouble
    last_change_time: float | None = None
    pending: PendingChange | None = None
    failed: tuple[FailedSetting, ...] = ()
    num_breaches: int = 0  # windows in a row that breached the SLO
    tuned: Condition = NOT_OBSERVED

    def blocked_until(self, knobs: Knobs, now: float) -> float | None:
        for f in self.failed:
            if f.knobs == knobs and now < f.until:
                return f.until
        return None


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


@dataclass(frozen=True)
class _Reading:
    """An observation measured against the policy."""

    ttft: float  # p99 / SLO (0 when there was nothing to measure)
    itl: float
    score: float  # the worse of the two
    trouble: str | None  # preemptions or failed steps, described
    text: str  # the figures, for reasons

    @property
    def met(self) -> bool:
        return self.score <= 1


def decide(state: TunerState, obs: Observation | None, policy: TuningPolicy, now: float) -> Decision:
    if policy.mode == "off":
        return _stay(state, now, "tuning is off", None, state.tuned)
    clamped = _clamp(state.knobs, policy)
    if clamped != state.knobs:
        return _move(state, policy, now, CLAMP, clamped, f"{state.knobs.describe()} lies outside the bounds",
                     None, state.tuned)
    if obs is None or obs.num_samples < policy.min_samples:
        n = 0 if obs is None else obs.num_samples
        why = f"too few samples ({n} first tokens in the window, {policy.min_samples} needed)"
        return _stay(state, now, why + (f"; {'; '.join(obs.errors)}" if obs and obs.errors else ""), None,
                     state.tuned)
    r = _read(obs, policy)
    cooling = state.last_change_time is not None and now - state.last_change_time < policy.cooldown
    if cooling and r.trouble is None:
        left = policy.cooldown - (now - state.last_change_time)
        return _stay(state, now, f"cooling down after the last change ({left:.0f} s left); {r.text}", r.met,
                     state.tuned)

    healthy = r.met and r.trouble is None
    s = dataclasses.replace(state, pending=None, num_breaches=0 if r.met else state.num_breaches + 1,
                            last_good=state.knobs if healthy else state.last_good)
    if state.pending is not None and not healthy:
        p = state.pending
        worse = p.before_met or r.score > p.before_score * (1 + policy.worse_tolerance)
        if worse and state.blocked_until(p.before, now) is None:
            s = dataclasses.replace(s, failed=_mark_failed(s.failed, state.knobs, now, policy))
            what = r.trouble or f"worst p99/SLO {p.before_score:.2f} -> {r.score:.2f}"
            where = "the last good setting" if p.before_met else "the setting before it"
            return _move(s, policy, now, ROLLBACK, p.before,
                         f"the change to {state.knobs.describe()} made things worse ({what}); back to {where}",
                         r, _breached(r))

    if r.trouble is not None:
        return _correct(s, policy, now, r, [_back_off_seqs(state.knobs, policy)], r.trouble)
    if not r.met:
        if s.num_breaches < policy.confirm_breaches and r.score < policy.severe_ratio:
            return _stay(s, now, f"SLO breached in {s.num_breaches} window(s) of {policy.confirm_breaches} "
                                 f"needed to act; {r.text}", False, _breached(r))
        return _correct(s, policy, now, r, _corrections(state.knobs, obs, r, policy), "SLO breached")

    met = Condition("True", "SLOMet", f"{r.text} at {state.knobs.describe()}")
    target = state.knobs.replace(max_num_seqs=min(policy.max_num_seqs_bounds.max,
                                                  state.knobs.max_num_seqs + policy.seqs_step))
    room = 1 - policy.headroom
    if r.score > room:
        why = f"SLO met within the hysteresis band (worst p99 at {r.score:.0%} of its SLO)"
    elif obs.kv_usage >= policy.kv_pressure:
        why = f"SLO met; KV usage {obs.kv_usage:.0%} at or above the {policy.kv_pressure:.0%} pressure threshold"
    elif obs.queued < policy.min_waiting:
        why = f"SLO met; {obs.queued:.1f} requests waiting on average, so a larger batch would not help"
    elif target == state.knobs:
        why = "SLO met with headroom; max_num_seqs at its upper bound"
    elif (until := s.blocked_until(target, now)) is not None:
        why = f"SLO met with headroom; {target.describe()} made things worse, not retried for {until - now:.0f} s"
    else:
        return _move(s, policy, now, RAISE_SEQS, target,
                     f"both p99s under {room:.0%} of their SLO, KV usage {obs.kv_usage:.0%} and "
                     f"{obs.queued:.1f} requests waiting: {r.text}", r, met)
    return _stay(s, now, f"{why}; {r.text}", True, met)


def _read(obs: Observation, policy: TuningPolicy) -> _Reading:
    ttft = (obs.ttft_p99_s or 0.0) * 1000 / policy.ttft_p99_ms
    itl = (obs.itl_p99_s or 0.0) * 1000 / policy.itl_p99_ms
    trouble = None
    if obs.preemption_rate > policy.max_preemption_rate:
        trouble = f"{obs.preemption_rate:.2f} preemptions/s with KV usage at {obs.kv_usage:.0%}"
    elif obs.error_rate > policy.max_error_rate:
        trouble = f"{obs.error_rate:.2f} failed engine steps/s"
    text = (f"p99 TTFT {_ms(obs.ttft_p99_s)} (SLO {policy.ttft_p99_ms:g} ms), p99 ITL {_ms(obs.itl_p99_s)} "
            f"(SLO {policy.itl_p99_ms:g} ms), KV {obs.kv_usage:.0%}, {obs.queued:.1f} waiting, "
            f"{obs.num_samples} samples")
    return _Reading(ttft, itl, max(ttft, itl), trouble, text)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def _chunk_bounds(knobs: Knobs, policy: TuningPolicy) -> KnobBounds:
    """A chunk above the step's token budget computes no more per step, so the budget caps the range."""
    b = policy.prefill_chunk_size_bounds
    return KnobBounds(b.min, max(b.min, min(b.max, knobs.max_num_batched_tokens)))


def _clamp(knobs: Knobs, policy: TuningPolicy) -> Knobs:
    b = policy.prefill_chunk_size_bounds
    return knobs.replace(max_num_seqs=policy.max_num_seqs_bounds.clamp(knobs.max_num_seqs),
                         prefill_chunk_size=b.clamp(knobs.prefill_chunk_size))


def _back_off_seqs(k: Knobs, policy: TuningPolicy) -> tuple[str, Knobs]:
    lower = policy.max_num_seqs_bounds.clamp(math.floor(k.max_num_seqs * policy.backoff_factor))
    return BACK_OFF_SEQS, k.replace(max_num_seqs=lower)


def _corrections(k: Knobs, obs: Observation, r: _Reading, policy: TuningPolicy) -> list[tuple[str, Knobs]]:
    """The moves that can cure this breach, best first."""
    room = 1 - policy.headroom
    chunks = _chunk_bounds(k, policy)
    smaller_chunk = k.replace(prefill_chunk_size=chunks.clamp(math.floor(k.prefill_chunk_size / policy.chunk_factor)))
    larger_chunk = k.replace(prefill_chunk_size=chunks.clamp(math.ceil(k.prefill_chunk_size * policy.chunk_factor)))
    more_seqs = k.replace(max_num_seqs=policy.max_num_seqs_bounds.clamp(k.max_num_seqs + policy.seqs_step))
    if r.itl > 1 and r.ttft <= room:  # decode steps are slow while first tokens come early: prefill stalls them
        return [(LOWER_CHUNK, smaller_chunk), _back_off_seqs(k, policy)]
    if r.ttft > 1 and r.itl <= room:
        if obs.queued >= policy.min_waiting and obs.kv_usage < policy.kv_pressure:  # the batch cap makes them wait
            return [(RAISE_SEQS, more_seqs), (RAISE_CHUNK, larger_chunk)]
        return [(RAISE_CHUNK, larger_chunk)]  # prompts are cut into too many steps
    return [_back_off_seqs(k, policy)]


def _correct(s: TunerState, policy: TuningPolicy, now: float, r: _Reading, moves: list[tuple[str, Knobs]],
             why: str) -> Decision:
    """Take the first move that changes something and has not failed lately; else say why none can."""
    blocked = []
    for action, target in moves:
        if target == s.knobs:
            continue
        until = s.blocked_until(target, now)
        if until is None:
            return _move(s, policy, now, action, target, f"{why}: {r.text}", r, _breached(r))
        blocked.append(f"{action} to {target.describe()} made things worse (retry in {until - now:.0f} s)")
    if blocked:
        tuned = Condition("False", "NoBetterSetting", f"{r.text}; " + "; ".join(blocked))
    else:
        names = ", ".join(a for a, _ in moves)
        tuned = Condition("False", "BoundsReached",
                          f"{r.text}; the correction needed ({names}) is at the bounds of {s.knobs.describe()}")
    return _stay(s, now, f"{why} and no move left: {tuned.message}", r.met, tuned)


def _breached(r: _Reading) -> Condition:
    return Condition("False", "SLOBreached", r.trouble + "; " + r.text if r.trouble else r.text)


def _mark_failed(failed: tuple[FailedSetting, ...], knobs: Knobs, now: float,
                 policy: TuningPolicy) -> tuple[FailedSetting, ...]:
    n = next((f.num_failures for f in failed if f.knobs == knobs), 0) + 1
    entry = FailedSetting(knobs, now + policy.retry_after_s * 2 ** (n - 1), n)
    return tuple(f for f in failed if f.knobs != knobs) + (entry,)


def _stay(state: TunerState, now: float, reason: str, met: bool | None, tuned: Condition) -> Decision:
    return Decision(HOLD, reason, now, None, False, met, tuned, dataclasses.replace(state, tuned=tuned))


def _move(s: TunerState, policy: TuningPolicy, now: float, action: str, target: Knobs, reason: str,
          r: _Reading | None, tuned: Condition) -> Decision:
    """A change: applied in auto mode (the next window judges it), only recommended in observe mode."""
    met = None if r is None else r.met
    if policy.mode != "auto":
        return Decision(action, f"recommended: {reason}", now, target, False, met, tuned,
                        dataclasses.replace(s, tuned=tuned))
    pending = None
    if r is not None and action != ROLLBACK:
        pending = PendingChange(s.knobs, r.score, r.met and r.trouble is None)
    nxt = dataclasses.replace(s, knobs=target, last_change_time=now, pending=pending, tuned=tuned)
    return Decision(action, reason, now, target, True, met, tuned, nxt)
