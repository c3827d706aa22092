"""The tuner's decision, a pure function: `decide(state, observation, policy, now) -> Decision`.

TTFT is read as the larger of its p99 and the time the backlog takes to drain: a queue shows there a
window before its first tokens do. Rules, in order (docs/tuning.md explains each and why):
1. knobs outside the bounds are brought inside at once;
2. a window with too few samples decides nothing; during the cooldown after a change nothing changes
   unless pods preempt or fail;
3. the first window after a change judges it: a change that broke a met SLO (or brought preemptions or
   errors) is rolled back to the last good setting; a correction that failed to improve the p99 it aimed
   at (with no more work of the kind that drives it: throughput for TTFT, prefill for ITL), or pushed the
   other p99 over its SLO (unless the aimed p99 is now met and the new breach is smaller), is reverted;
   rule 6's chunk raise is judged as a TTFT cure (a backlog building as it was made keeps TTFT rising
   for a window); the failed setting is not retried before
   `retry_after_s`, doubling each time the same knob fails the same way again;
4. preemptions or failed steps back max_num_seqs off multiplicatively (every back-off halves the batch
   that actually ran, when fewer ran than the cap);
5. a breach (confirmed over `confirm_breaches` windows that do not overlap, with at most a window between
   two of them, unless severe, or TTFT over with decodes absent or cheap) is diagnosed:
   ITL over while TTFT is within its SLO lowers prefill_chunk_size (prefill stalls decode); TTFT over while
   ITL has headroom raises max_num_seqs when the batch cap holds requests back, else prefill_chunk_size (two
   steps at once when one would not bring TTFT under the headroom); both over as TTFT turns severe and the
   farther over adds capacity the same way first (a queue compounds);
   otherwise max_num_seqs backs off (a smaller chunk first when the cap binds: it costs no capacity), and
   should neither be left while TTFT is severe and the farther over, the chunk goes up;
6. with the SLO met, TTFT past half the headroom line and nothing decoding (no ITL in the window),
   prefill_chunk_size goes up one step: prefill is the work near its SLO and no decode pays for it; else
   with both p99s under (1 - headroom) x SLO, KV usage under the pressure threshold and the batch cap
   holding requests back, max_num_seqs goes up one step; between headroom and SLO nothing moves;
7. (checked before rule 5) a chunk raised while decodes were absent or cheap (p99 ITL under half the headroom
   line) goes back to where it was as soon as decodes return over their ITL SLO, without a second window to
   confirm: what justified the raise is gone (with a TTFT cure right before it, to the chunk before both).
Against oscillation besides the hysteresis band and the cooldown: a back-off leaves a ceiling (the
setting it left is not approached again before `retry_after_s`), and a move back to a setting one of the
last three changes left marks the setting it leaves as failed (unless a chunk raise with decodes cheap
leaves it: that is rule 7's way back), so moves that each help one p99 cannot take turns forever.
`Tuned` is True while the SLO is met (a mild breach not yet confirmed leaves it True), False with
`SLOBreached` while correcting, `BoundsReached` when the correction needed lies outside the bounds,
`NoBetterSetting` when every correction left was tried and made things worse (that verdict stands
through later probes until the SLO is met). What failed is remembered with the load's mix (prompt tokens
per request) and blocks only under a like load: a move that failed for short chats may be the cure when
long documents come. In `observe` mode the decision is only a recommendation:
the state keeps its knobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from iterserve.operator.tuning.actions import (
    AIMS, BACK_OFF_SEQS, CLAMP, HOLD, LOWER_CHUNK, RAISE_CHUNK, RAISE_SEQS, ROLLBACK,
)
from iterserve.operator.tuning.chunk_moves import (
    cheap_raise_base, chunk_bounds, chunk_steps, decodes_back, decodes_cheap, headroom_raise,
)
from iterserve.operator.tuning.failures import FailedSetting, mark_failed
from iterserve.operator.tuning.knobs import Knobs
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.reading import Reading, count_breach, read


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
    # the chunk in force before the raises made while decodes were absent or cheap (rule 6, or a TTFT cure
    # with p99 ITL under half the headroom line), put back as soon as decodes breach ITL (rule 7); None: no
    # such raise stands
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
    r = read(obs, policy)
    cooling = state.last_change_time is not None and now - state.last_change_time < policy.cooldown
    if cooling and r.trouble is None:
        left = policy.cooldown - (now - state.last_change_time)
        return _stay(state, now, f"cooling down after the last change ({left:.0f} s left); {r.text}", r.met,
                     state.tuned)

    healthy = r.met and r.trouble is None
    num_ttft, ttft_end = count_breach(state.num_ttft_breaches, state.ttft_breach_end, r.ttft > 1, obs, policy)
    num_itl, itl_end = count_breach(state.num_itl_breaches, state.itl_breach_end, r.itl > 1, obs, policy)
    s = dataclasses.replace(state, pending=None, last_good=state.knobs if healthy else state.last_good,
                            num_ttft_breaches=num_ttft, ttft_breach_end=ttft_end,
                            num_itl_breaches=num_itl, itl_breach_end=itl_end)
    if state.pending is not None and not healthy:
        p = state.pending
        worse = _judge(p, r, obs, policy)
        if worse is not None:
            # the setting went back to is cleared (a back-off marked it as a ceiling: the back-off was wrong)
            failed = tuple(f for f in s.failed if f.knobs != p.before)
            s = dataclasses.replace(s, failed=mark_failed(failed, state.knobs, now, policy, p.action, r.mix))
            where = "the last good setting" if p.before_healthy else "the setting before it"
            return _move(s, policy, now, ROLLBACK, p.before,
                         f"the change to {state.knobs.describe()} made things worse ({worse}); back to {where}",
                         r, _breached(r, state.tuned))

    if r.trouble is not None:
        return _correct(s, policy, now, r, [_back_off_seqs(state.knobs, obs, policy)], r.trouble, aimed=False)
    if (chunk := decodes_back(s.knobs, s.chunk_before_cheap_raise, r)) is not None \
            and s.blocked_until(chunk, now, r.mix, policy.mix_factor) is None:
        return _move(s, policy, now, LOWER_CHUNK, chunk,
                     f"decodes are back over their ITL SLO, and chunk {state.knobs.prefill_chunk_size} was raised "
                     f"while decodes were absent or cheap: back to {chunk.prefill_chunk_size}: {r.text}", r,
                     _breached(r, state.tuned), aim="itl")
    if not r.met:
        # a mild breach must last confirm_breaches windows before it is acted on, each p99 on its own: one
        # noisy window of ITL while TTFT is over does not turn a TTFT cure into an ITL one
        # ... unless decodes are absent or cheap: the cure for TTFT then costs them nothing that matters, a
        # wrong one is judged in the next window, and rule 7 undoes it in one move once decodes breach
        ttft_bad = r.ttft > 1 and (s.num_ttft_breaches >= policy.confirm_breaches or r.ttft >= policy.severe_ratio
                                   or decodes_cheap(r, policy))
        itl_bad = r.itl > 1 and (s.num_itl_breaches >= policy.confirm_breaches or r.itl >= policy.severe_ratio)
        if not (ttft_bad or itl_bad):
            over = [f"p99 {name} over in {n} separate recent window(s)" for name, ratio, n in
                    (("TTFT", r.ttft, s.num_ttft_breaches), ("ITL", r.itl, s.num_itl_breaches)) if ratio > 1]
            # the verdict has the action's hysteresis: a met SLO stays met until the breach is confirmed,
            # so one noisy window does not flip the condition (nor a quiet spell after it freeze it False)
            tuned = state.tuned if state.tuned.status == "True" else _breached(r, state.tuned)
            return _stay(s, now, f"{', '.join(over)}, {policy.confirm_breaches} needed to act; {r.text}", False,
                         tuned)
        moves = _corrections(state.knobs, obs, r, policy, ttft_bad, itl_bad, new_queue=s.num_ttft_breaches == 1)
        return _correct(s, policy, now, r, moves, "SLO breached")

    met = Condition("True", "SLOMet", f"{r.text} at {state.knobs.describe()}")
    if (chunk := headroom_raise(state.knobs, r, policy)) is not None \
            and s.blocked_until(chunk, now, r.mix, policy.mix_factor) is None:
        return _move(s, policy, now, RAISE_CHUNK, chunk,
                     f"SLO met, TTFT past half the headroom line and nothing decoding: prefill is the work, "
                     f"and a larger chunk costs no decode: {r.text}", r, met, aim="ttft")
    target = state.knobs.replace(max_num_seqs=min(policy.max_num_seqs_bounds.max,
                                                  state.knobs.max_num_seqs + policy.seqs_step))
    room = policy.headroom_line
    if r.score > room:
        why = f"SLO met within the hysteresis band (worst p99 at {r.score:.0%} of its SLO)"
    elif obs.kv_usage >= policy.kv_pressure:
        why = f"SLO met; KV usage {obs.kv_usage:.0%} at or above the {policy.kv_pressure:.0%} pressure threshold"
    elif not _cap_binds(state.knobs, obs, policy):
        why = (f"SLO met; {obs.running:.1f} running and {obs.queued:.1f} waiting on average: the batch cap "
               f"does not hold requests back, so a larger one would not help")
    elif target == state.knobs:
        why = "SLO met with headroom; max_num_seqs at its upper bound"
    elif (until := s.blocked_until(target, now, r.mix, policy.mix_factor)) is not None:
        why = f"SLO met with headroom; {target.describe()} made things worse, not retried for {until - now:.0f} s"
    else:
        return _move(s, policy, now, RAISE_SEQS, target,
                     f"both p99s under {room:.0%} of their SLO, KV usage {obs.kv_usage:.0%} and "
                     f"{obs.queued:.1f} requests waiting: {r.text}", r, met, aim=None)
    return _stay(s, now, f"{why}; {r.text}", True, met)


def _clamp(knobs: Knobs, policy: TuningPolicy) -> Knobs:
    b = policy.prefill_chunk_size_bounds
    return knobs.replace(max_num_seqs=policy.max_num_seqs_bounds.clamp(knobs.max_num_seqs),
                         prefill_chunk_size=b.clamp(knobs.prefill_chunk_size))


def _back_off_seqs(k: Knobs, obs: Observation, policy: TuningPolicy) -> tuple[str, Knobs]:
    """A multiplicative decrease of the batch that actually ran (per pod, the window's mean rounded up),
    not of a cap it never filled: as TCP halves its flight size rather than a window it did not use.
    Halving a cap of 64 that 6 requests run under changes nothing and would only cost a cooldown."""
    ran = math.ceil(obs.running / max(1, obs.num_pods)) if obs.running > 0 else k.max_num_seqs
    lower = policy.max_num_seqs_bounds.clamp(math.floor(min(k.max_num_seqs, ran) * policy.backoff_factor))
    return BACK_OFF_SEQS, k.replace(max_num_seqs=lower)  # never above k: rule 1 keeps k within the bounds


RECENT_MOVES = 3  # how many settings back a move counts as returning (see _remember_move)


def _judge(p: PendingChange, r: Reading, obs: Observation, policy: TuningPolicy) -> str | None:
    """Why the change behind `p` made things worse, or None when it did not."""
    tol = 1 + policy.worse_tolerance
    if p.before_healthy and p.aim is None:
        return r.trouble or f"it broke the SLO: {r.text}"
    if r.trouble and not p.before_trouble:
        return r.trouble
    if p.aim == "itl" and r.itl > p.before_itl * tol and obs.prompt_token_rate <= p.before_prompt_token_rate * tol:
        # a burst of prompts stalls decodes at any chunk: a cure is blamed only under no more prefill work
        return f"p99 ITL/SLO {p.before_itl:.2f} -> {r.itl:.2f} with no more prefill work"
    if p.aim == "ttft" and r.ttft > p.before_ttft * tol and obs.request_rate <= p.before_request_rate:
        # a backlog keeps TTFT growing for a while after capacity was added: more throughput forgives it
        return f"p99 TTFT/SLO {p.before_ttft:.2f} -> {r.ttft:.2f} with no more throughput"
    # pushing the other p99 over its SLO made things worse, unless the cure worked and the new breach is
    # smaller than the one it cured: that is progress, and the new breach is confirmed and diagnosed like any
    # other (the window right after a smaller chunk can hold the prompts it slowed down, a transient)
    if p.aim == "ttft" and p.before_itl <= 1 < r.itl and not r.ttft <= 1 < r.itl < p.before_ttft:
        return f"p99 ITL went over its SLO ({p.before_itl:.2f} -> {r.itl:.2f})"
    if p.aim == "itl" and p.before_ttft <= 1 < r.ttft and not r.itl <= 1 < r.ttft < p.before_itl:
        return f"p99 TTFT went over its SLO ({p.before_ttft:.2f} -> {r.ttft:.2f})"
    return None


def _raise_row_start(s: TunerState) -> Knobs:
    """The setting before the chunk raise that made the current setting, if the last change was one, else
    the current setting. A raise made while decodes were absent or cheap right after a TTFT cure serves
    the same documents as that cure, which the decodes left from the last phase (near their SLO) paid for:
    rule 7 puts back the chunk before both. In session 14's run T, 128 -> 256 -> 512 at a documents' onset
    came back to 256 only, and the chats after them breached there for another window."""
    if s.previous_action == RAISE_CHUNK and s.recent_knobs \
            and s.recent_knobs[-1].prefill_chunk_size < s.knobs.prefill_chunk_size:
        return s.recent_knobs[-1]
    return s.knobs


def _cap_binds(k: Knobs, obs: Observation, policy: TuningPolicy) -> bool:
    """Requests wait while the batch is (nearly) full: max_num_seqs is what holds them back. Waiting alone
    is not enough: a request arriving mid-step waits for the next one even in a half-empty batch."""
    full = obs.running >= policy.full_batch * k.max_num_seqs * max(1, obs.num_pods)
    return obs.queued >= policy.min_waiting and full


def _corrections(k: Knobs, obs: Observation, r: Reading, policy: TuningPolicy, ttft_bad: bool,
                 itl_bad: bool, new_queue: bool = False) -> list[tuple[str, Knobs]]:
    """The moves that can cure this (confirmed) breach, best first. `new_queue`: TTFT was within its SLO
    until this window (no earlier one that does not overlap it was over)."""
    room = policy.headroom_line
    chunks = chunk_bounds(k, policy)
    smaller = (LOWER_CHUNK, k.replace(prefill_chunk_size=chunks.clamp(math.floor(k.prefill_chunk_size
                                                                                / policy.chunk_factor))))
    # TTFT far over while ITL has headroom: the chunk may go up two steps at once (chunk_steps); should
    # that jump have failed lately, one step is still worth a try
    jumps = {chunks.clamp(math.ceil(k.prefill_chunk_size * policy.chunk_factor ** n))
             for n in range(chunk_steps(r.ttft, policy) if r.itl <= room else 1, 0, -1)}
    larger = [(RAISE_CHUNK, k.replace(prefill_chunk_size=c)) for c in sorted(jumps, reverse=True)]
    more = (RAISE_SEQS, k.replace(max_num_seqs=policy.max_num_seqs_bounds.clamp(k.max_num_seqs + policy.seqs_step)))
    fewer = _back_off_seqs(k, obs, policy)
    # requests wait for a place in the batch (and the KV cache could hold more): the cap is binding
    capped = _cap_binds(k, obs, policy) and obs.kv_usage < policy.kv_pressure
    if itl_bad and not ttft_bad:
        # decode steps are slow while first tokens come in time: prefill riding along in big chunks stalls
        # them. The chunk goes first even without TTFT headroom: a back-off queues requests and costs far
        # more TTFT (0.88 -> 2.63 of its SLO in one window in benchmarks/tuning.py) than a smaller chunk
        return [smaller, fewer]
    if ttft_bad and not itl_bad:
        if r.itl <= room:
            return [more, *larger] if capped else larger  # too few places in the batch, or too many steps
        return [smaller, more] if capped else larger  # make ITL room before adding sequences
    overload = [smaller, fewer] if capped else [fewer, smaller]  # a smaller chunk first: it costs no capacity
    queue_leads = r.ttft >= policy.severe_ratio and r.ttft > r.itl
    if new_queue and queue_leads:
        # both over, TTFT suddenly and the farther: a new load's prompts queue and stall the decodes left from
        # the last one. The queue compounds, the stall drains: less capacity would only grow the queue. Once
        # the breach outlasts a window, an overload is the likelier cause and the back-off below applies
        return ([more, *larger] if capped else larger) + overload
    # ... and should neither remedy for an overload be left (at their bounds, or failed lately), a larger
    # chunk while TTFT is severe and the farther over: holding still lets the queue compound (session 13's
    # run R sat at 256 for 36 s this way, p99 TTFT 3.7x its SLO and 14 documents waiting, while 512 was free)
    return overload + (larger if queue_leads else [])


def _correct(s: TunerState, policy: TuningPolicy, now: float, r: Reading, moves: list[tuple[str, Knobs]],
             why: str, aimed: bool = True) -> Decision:
    """Take the first move that changes something and has not failed lately; else say why none can."""
    blocked = []
    for action, target in moves:
        if target == s.knobs:
            continue
        until = s.blocked_until(target, now, r.mix, policy.mix_factor)
        if until is None:
            if policy.mode == "auto":  # a recommendation moves nothing, so there is nothing to remember
                s = dataclasses.replace(s, failed=_remember_move(s, action, target, now, policy, r))
            return _move(s, policy, now, action, target, f"{why}: {r.text}", r, _breached(r, s.tuned),
                         aim=AIMS[action] if aimed else None)
        blocked.append(f"{action} to {target.describe()} made things worse (retry in {until - now:.0f} s)")
    if blocked:
        tuned = Condition("False", "NoBetterSetting", f"{r.text}; " + "; ".join(blocked))
    else:
        names = ", ".join(a for a, _ in moves)
        tuned = Condition("False", "BoundsReached",
                          f"{r.text}; the correction needed ({names}) is at the bounds of {s.knobs.describe()}")
    return _stay(s, now, f"{why} and no move left: {tuned.message}", r.met, tuned)


def _remember_move(s: TunerState, action: str, target: Knobs, now: float, policy: TuningPolicy,
                   r: Reading) -> tuple[FailedSetting, ...]:
    """What a move teaches before it is judged. The setting a back-off leaves is a ceiling for the raises
    that follow. A move back to a setting one of the last RECENT_MOVES changes left says the moves since
    did not pay: without this, two moves that each help one p99 (a larger chunk for TTFT, a smaller one
    for ITL) would take turns, and so would three (the chunk 64 -> 32 -> 16 -> 64 -> ... in the
    simulation's impossible load, two steps down to make ITL room and a two-step jump back for TTFT).
    A chunk raise made while decodes are absent or cheap is the exception: the setting it leaves is
    rule 7's way back for when decodes return over their ITL SLO, and the gap between the two conditions
    (under half the headroom line, over the SLO) is the hysteresis. Marked failed, it was blocked in
    session 14's runs T, U and V: chunk 128, which had met the SLO for 230 s of chats, was left at the
    documents' onset by a raise back to the first setting, 256; when the chats came back, the window's
    prompt tokens per request still held the documents, and 256 stayed in force for 16 s of them."""
    if action == BACK_OFF_SEQS:
        return mark_failed(s.failed, s.knobs, now, policy, RAISE_SEQS, r.mix)
    if action == RAISE_CHUNK and decodes_cheap(r, policy):
        return s.failed
    if target in s.recent_knobs and s.previous_action is not None:
        return mark_failed(s.failed, s.knobs, now, policy, s.previous_action, r.mix)
    return s.failed


def _breached(r: Reading, previous: Condition) -> Condition:
    """SLOBreached while correcting; once no setting was found to meet the SLO, that verdict stands through
    the later probes until the SLO is met again, so the condition does not flap with each retry."""
    text = r.trouble + "; " + r.text if r.trouble else r.text
    if previous.status == "False" and previous.reason in ("NoBetterSetting", "BoundsReached"):
        return Condition("False", previous.reason, f"{text}; trying another setting")
    return Condition("False", "SLOBreached", text)


def _stay(state: TunerState, now: float, reason: str, met: bool | None, tuned: Condition) -> Decision:
    return Decision(HOLD, reason, now, None, False, met, tuned, dataclasses.replace(state, tuned=tuned))


def _move(s: TunerState, policy: TuningPolicy, now: float, action: str, target: Knobs, reason: str,
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
