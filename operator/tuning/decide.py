"""The tuner's decision, a pure function: `decide(state, observation, policy, now) -> Decision`.

`RULES` is an ordered table of named rules. Each reads the window (`Window`) and either decides or passes
to the next; the first that decides wins, and the last always does. Each rule's docstring says why it is
there and why it stands where it does; docs/tuning.md gives the evidence, under the same names.

TTFT is read as the larger of its p99 and the time the backlog takes to drain (`reading.read`): a queue
shows there a window before its first tokens do. In `observe` mode a move is only a recommendation and the
state keeps its knobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cached_property

from iterserve.operator.tuning.actions import (  # noqa: F401  (the action names' usual import path)
    AIMS,
    BACK_OFF_SEQS,
    CLAMP,
    HOLD,
    LOWER_CHUNK,
    RAISE_CHUNK,
    RAISE_SEQS,
    ROLLBACK,
)
from iterserve.operator.tuning.chunk_moves import decodes_back, decodes_cheap, headroom_raise
from iterserve.operator.tuning.corrections import back_off_seqs, cap_binds, clamp, correct, corrections, judge
from iterserve.operator.tuning.decision import (  # noqa: F401  (re-exported: decide's types)
    NOT_OBSERVED,
    Condition,
    Decision,
    PendingChange,
    TunerState,
    breached,
    move,
    stay,
)
from iterserve.operator.tuning.failures import mark_failed
from iterserve.operator.tuning.fleet_change import ScaleOut, told
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.reading import Reading, count_breach, read


class Window:
    """One call's inputs, and what the rules derive from them, each computed once on first use: the
    reading (only after `too_few_samples` made sure there is an observation) and the state with this
    window's bookkeeping (recent breaches, the rollback point) that every later decision carries on."""

    def __init__(self, state: TunerState, obs: Observation | None, policy: TuningPolicy, now: float,
                 scale_out: ScaleOut | None = None):
        self.state, self.obs, self.policy, self.now = state, obs, policy, now
        # what a scale-out in flight waits for (fleet_change.py), or None; a drain as this window's queue has it
        self.scale_out = told(scale_out, None if obs is None else obs.queued)

    @property
    def seen(self) -> Observation:
        """The observation, for the rules after `too_few_samples` (which ends a window without one)."""
        assert self.obs is not None
        return self.obs

    @cached_property
    def r(self) -> Reading:
        return read(self.seen, self.policy)

    @property
    def healthy(self) -> bool:
        return self.r.met and self.r.trouble is None

    @cached_property
    def s(self) -> TunerState:
        state, r, obs, policy = self.state, self.r, self.seen, self.policy
        num_ttft, ttft_end = count_breach(state.num_ttft_breaches, state.ttft_breach_end, r.ttft > 1, obs, policy)
        num_itl, itl_end = count_breach(state.num_itl_breaches, state.itl_breach_end, r.itl > 1, obs, policy)
        return dataclasses.replace(state, pending=None, last_good=state.knobs if self.healthy else state.last_good,
                                   num_ttft_breaches=num_ttft, ttft_breach_end=ttft_end,
                                   num_itl_breaches=num_itl, itl_breach_end=itl_end)


Rule = Callable[[Window], "Decision | None"]


def tuning_off(w: Window) -> Decision | None:
    """Mode off: the tuner watches and reports, and nothing it reads moves a knob."""
    if w.policy.mode == "off":
        return stay(w.state, w.now, "tuning is off", None, w.state.tuned)
    return None


def clamp_into_bounds(w: Window) -> Decision | None:
    """Knobs outside the bounds are brought inside at once, before any window is read: the bounds are the
    user's word, and knobs set by hand or bounds narrowed by a spec edit must not wait for a breach."""
    clamped = clamp(w.state.knobs, w.policy)
    if clamped == w.state.knobs:
        return None
    return move(w.state, w.policy, w.now, CLAMP, clamped, f"{w.state.knobs.describe()} lies outside the bounds",
                None, w.state.tuned)


def too_few_samples(w: Window) -> Decision | None:
    """A p99 over a handful of first tokens is noise: a window with fewer than `min_samples` decides
    nothing and keeps the verdict (what the scrape could not read is said in the reason)."""
    obs, policy = w.obs, w.policy
    if obs is not None and obs.num_samples >= policy.min_samples:
        return None
    n = 0 if obs is None else obs.num_samples
    why = f"too few samples ({n} first tokens in the window, {policy.min_samples} needed)"
    return stay(w.state, w.now, why + (f"; {'; '.join(obs.errors)}" if obs and obs.errors else ""), None,
                w.state.tuned)


def cooling_down(w: Window) -> Decision | None:
    """For `cooldown_s` after a change the window still holds requests served under the setting before
    it, so nothing moves; preemptions or failed steps cannot wait and pass on to the rules below."""
    state, policy = w.state, w.policy
    if state.last_change_time is None or w.now - state.last_change_time >= policy.cooldown or w.r.trouble:
        return None
    left = policy.cooldown - (w.now - state.last_change_time)
    return stay(state, w.now, f"cooling down after the last change ({left:.0f} s left); {w.r.text}", w.r.met,
                state.tuned)


def judge_last_change(w: Window) -> Decision | None:
    """The first window measured after a change judges it (`corrections.judge`): a change that broke a met
    SLO or brought preemptions or errors, or a cure that failed its aim or pushed the other p99 over, is
    rolled back, and the setting it left is not retried before `retry_after_s` (doubling on each repeat).
    A healthy window needs no judge. It comes before every cure: a cure made on top of a bad change would
    be judged against the wrong setting."""
    p = w.state.pending
    if p is None or w.healthy:
        return None
    worse = judge(p, w.r, w.seen, w.policy)
    if worse is None:
        return None
    if w.scale_out is not None and w.r.trouble is None and p.before.max_num_seqs < w.state.knobs.max_num_seqs:
        # going back to fewer places is a back-off, which waits while a scale-out's pods start and drain the
        # backlog (cure_breach): the windows they start in show their start, not what the change did
        return stay(dataclasses.replace(w.s, pending=p), w.now,
                    f"the change to {w.state.knobs.describe()} looks worse ({worse}), but "
                    f"{w.scale_out}: not going back to fewer places while they do", w.r.met,
                    breached(w.r, w.state.tuned))
    # the setting gone back to is cleared (a back-off marked it as a ceiling: the back-off was wrong)
    failed = tuple(f for f in w.s.failed if f.knobs != p.before)
    s = dataclasses.replace(w.s, failed=mark_failed(failed, w.state.knobs, w.now, w.policy, p.action, w.r.mix))
    where = "the last good setting" if p.before_healthy else "the setting before it"
    return move(s, w.policy, w.now, ROLLBACK, p.before,
                f"the change to {w.state.knobs.describe()} made things worse ({worse}); back to {where}",
                w.r, breached(w.r, w.state.tuned))


def back_off_on_trouble(w: Window) -> Decision | None:
    """Preemptions or failed steps say the KV cache cannot hold the batch: `max_num_seqs` backs off
    multiplicatively (from the batch that actually ran), whatever the p99s say."""
    if w.r.trouble is None:
        return None
    return correct(w.s, w.policy, w.now, w.r, [back_off_seqs(w.state.knobs, w.seen, w.policy)], w.r.trouble,
                   aimed=False)


def chunk_back_for_decodes(w: Window) -> Decision | None:
    """A chunk raised while decodes were absent or cheap goes back to the chunk before those raises in one
    move as soon as decodes return over their ITL SLO: what justified the raise is gone. It comes before
    `cure_breach` so that it needs no second window to confirm the breach."""
    s, r = w.s, w.r
    chunk = decodes_back(s.knobs, s.chunk_before_cheap_raise, r)
    if chunk is None or s.blocked_until(chunk, w.now, r.mix, w.policy.mix_factor) is not None:
        return None
    return move(s, w.policy, w.now, LOWER_CHUNK, chunk,
                f"decodes are back over their ITL SLO, and chunk {w.state.knobs.prefill_chunk_size} was raised "
                f"while decodes were absent or cheap: back to {chunk.prefill_chunk_size}: {r.text}", r,
                breached(r, w.state.tuned), aim="itl")


def cure_breach(w: Window) -> Decision | None:
    """A breach is cured once confirmed: over `confirm_breaches` windows that do not overlap (each p99 on
    its own), or at once when severe, or when TTFT is over with decodes absent or cheap (the cure then
    costs them nothing that matters, and a wrong one is judged in the next window). An unconfirmed breach
    moves nothing, so one noisy window cannot toggle a knob; `corrections.corrections` picks the cure for
    the p99 that is over. While pods a scale-out added come up (`scale_out`), that cure is not a back-off
    of max_num_seqs; nor a larger chunk while ITL is over too, nor once they are all ready, settling or
    draining the backlog gathered before them (fleet_change.py)."""
    s, r, policy, state = w.s, w.r, w.policy, w.state
    if r.met:
        return None
    ttft_bad = r.ttft > 1 and (s.num_ttft_breaches >= policy.confirm_breaches or r.ttft >= policy.severe_ratio
                               or decodes_cheap(r, policy))
    itl_bad = r.itl > 1 and (s.num_itl_breaches >= policy.confirm_breaches or r.itl >= policy.severe_ratio)
    if not (ttft_bad or itl_bad):
        over = [f"p99 {name} over in {n} separate recent window(s)" for name, ratio, n in
                (("TTFT", r.ttft, s.num_ttft_breaches), ("ITL", r.itl, s.num_itl_breaches)) if ratio > 1]
        # the verdict has the action's hysteresis: a met SLO stays met until the breach is confirmed,
        # so one noisy window does not flip the condition (nor a quiet spell after it freeze it False)
        tuned = state.tuned if state.tuned.status == "True" else breached(r, state.tuned)
        return stay(s, w.now, f"{', '.join(over)}, {policy.confirm_breaches} needed to act; {r.text}", False, tuned)
    moves = corrections(state.knobs, w.seen, r, policy, ttft_bad, itl_bad, new_queue=s.num_ttft_breaches == 1)
    why = "SLO breached"
    if w.scale_out is not None:
        # fewer places would cut what the pods carry as the fleet grows to carry more; and TTFT's breach is
        # the backlog the pods come for, not worth ITL's price of a larger chunk: not with ITL over already,
        # nor once the pods are up (settling or draining it), the larger fleet clearing it
        held = {BACK_OFF_SEQS: "backing max_num_seqs off"}
        if w.scale_out.ready or r.itl > 1:
            held[RAISE_CHUNK] = "raising the chunk"
        if moves and moves[0][0] in held:
            why = f"SLO breached, and {w.scale_out}: not {held[moves[0][0]]}"
        changes = [action for action, knobs in moves if knobs != state.knobs]
        if changes and all(action in held for action in changes):
            names = " or ".join(dict.fromkeys(held[action] for action in changes))
            return stay(s, w.now, f"SLO breached, but {w.scale_out}: not {names} while they do; {r.text}", False,
                        breached(r, state.tuned))
        moves = [m for m in moves if m[0] not in held]
    return correct(s, policy, w.now, r, moves, why)


def raise_chunk_for_prefill(w: Window) -> Decision | None:
    """SLO met, TTFT past half the headroom line and nothing decoding: prefill is the work near its SLO and
    no decode pays for a larger chunk, so it goes up one step, inside the hysteresis band too, before a
    queue of long prompts breaches."""
    chunk = headroom_raise(w.state.knobs, w.r, w.policy)
    if chunk is None or w.s.blocked_until(chunk, w.now, w.r.mix, w.policy.mix_factor) is not None:
        return None
    return move(w.s, w.policy, w.now, RAISE_CHUNK, chunk,
                f"SLO met, TTFT past half the headroom line and nothing decoding: prefill is the work, "
                f"and a larger chunk costs no decode: {w.r.text}", w.r, _slo_met(w), aim="ttft")


def raise_seqs_with_headroom(w: Window) -> Decision:
    """SLO met: with both p99s under the headroom line, KV usage under the pressure threshold and the batch
    cap holding requests back, `max_num_seqs` goes up one step; otherwise nothing moves (between the
    headroom line and the SLO lies the hysteresis band). The table's last rule: it always decides."""
    s, r, obs, policy, now, knobs = w.s, w.r, w.seen, w.policy, w.now, w.state.knobs
    target = knobs.replace(max_num_seqs=min(policy.max_num_seqs_bounds.max, knobs.max_num_seqs + policy.seqs_step))
    room = policy.headroom_line
    if r.score > room:
        why = f"SLO met within the hysteresis band (worst p99 at {r.score:.0%} of its SLO)"
    elif obs.kv_usage >= policy.kv_pressure:
        why = f"SLO met; KV usage {obs.kv_usage:.0%} at or above the {policy.kv_pressure:.0%} pressure threshold"
    elif not cap_binds(knobs, obs, policy):
        why = (f"SLO met; {obs.in_batch:.1f} running and {obs.queued:.1f} waiting on average: the batch cap "
               f"does not hold requests back, so a larger one would not help")
    elif target == knobs:
        why = "SLO met with headroom; max_num_seqs at its upper bound"
    elif (until := s.blocked_until(target, now, r.mix, policy.mix_factor)) is not None:
        why = f"SLO met with headroom; {target.describe()} made things worse, not retried for {until - now:.0f} s"
    else:
        return move(s, policy, now, RAISE_SEQS, target,
                    f"both p99s under {room:.0%} of their SLO, KV usage {obs.kv_usage:.0%} and "
                    f"{obs.queued:.1f} requests waiting: {r.text}", r, _slo_met(w), aim=None)
    return stay(s, now, f"{why}; {r.text}", True, _slo_met(w))


def _slo_met(w: Window) -> Condition:
    return Condition("True", "SLOMet", f"{w.r.text} at {w.state.knobs.describe()}")


RULES: tuple[Rule, ...] = (
    tuning_off, clamp_into_bounds, too_few_samples, cooling_down, judge_last_change, back_off_on_trouble,
    chunk_back_for_decodes, cure_breach, raise_chunk_for_prefill, raise_seqs_with_headroom,
)


def decide(state: TunerState, obs: Observation | None, policy: TuningPolicy, now: float,
           scale_out: ScaleOut | None = None) -> Decision:
    """`scale_out`: what a scale-out in flight waits for (`fleet_change.scale_out_in_flight`), or None."""
    w = Window(state, obs, policy, now, scale_out)
    for rule in RULES:
        if (decision := rule(w)) is not None:
            return decision
    raise AssertionError("raise_seqs_with_headroom always decides")
