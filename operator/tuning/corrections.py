"""The tuner's cures and their bookkeeping, used by the rules in `decide`: which moves can cure a breach
and in what order (`corrections`), taking the first that has not failed lately (`correct`), judging the
last change on the window after it (`judge`), and what a move teaches before it is judged
(`remember_move`). docs/tuning.md gives the evidence behind each order."""

from __future__ import annotations

import dataclasses
import math

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.actions import AIMS, BACK_OFF_SEQS, LOWER_CHUNK, RAISE_CHUNK, RAISE_SEQS
from iterserve.operator.tuning.chunk_moves import chunk_bounds, chunk_steps, decodes_cheap
from iterserve.operator.tuning.decision import Condition, Decision, PendingChange, TunerState, breached, move, stay
from iterserve.operator.tuning.failures import FailedSetting, mark_failed
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import KnobBounds, TuningPolicy
from iterserve.operator.tuning.reading import Reading


def clamp(knobs: Knobs, policy: TuningPolicy) -> Knobs:
    b = policy.prefill_chunk_size_bounds
    return knobs.replace(max_num_seqs=policy.max_num_seqs_bounds.clamp(knobs.max_num_seqs),
                         prefill_chunk_size=b.clamp(knobs.prefill_chunk_size))


def back_off_seqs(k: Knobs, obs: Observation, policy: TuningPolicy) -> tuple[str, Knobs]:
    """A multiplicative decrease of the batch that actually ran (per pod, the window's mean rounded up),
    not of a cap it never filled: as TCP halves its flight size rather than a window it did not use.
    Halving a cap of 64 that 6 requests run under changes nothing and would only cost a cooldown. The batch
    is `in_batch` (the gauge's mean or Little's law, the larger): a gauge read between two requests halves
    a batch that was not there."""
    ran = math.ceil(obs.in_batch / max(1, obs.num_pods)) if obs.in_batch > 0 else k.max_num_seqs
    lower = policy.max_num_seqs_bounds.clamp(math.floor(min(k.max_num_seqs, ran) * policy.backoff_factor))
    return BACK_OFF_SEQS, k.replace(max_num_seqs=lower)  # never above k: the bounds rule keeps k inside


def judge(p: PendingChange, r: Reading, obs: Observation, policy: TuningPolicy) -> str | None:
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


def cap_binds(k: Knobs, obs: Observation, policy: TuningPolicy) -> bool:
    """Requests wait while the batch is (nearly) full: max_num_seqs is what holds them back. Waiting alone
    is not enough: a request arriving mid-step waits for the next one even in a half-empty batch."""
    full = obs.in_batch >= policy.full_batch * k.max_num_seqs * max(1, obs.num_pods)
    return obs.queued >= policy.min_waiting and full


def corrections(k: Knobs, obs: Observation, r: Reading, policy: TuningPolicy, ttft_bad: bool,
                itl_bad: bool, new_queue: bool = False) -> list[tuple[str, Knobs]]:
    """The moves that can cure this (confirmed) breach, best first. `new_queue`: TTFT was within its SLO
    until this window (no earlier one that does not overlap it was over)."""
    room = policy.headroom_line
    chunks = chunk_bounds(k, policy)
    smaller = (LOWER_CHUNK, k.replace(prefill_chunk_size=chunks.clamp(math.floor(k.prefill_chunk_size
                                                                                / policy.chunk_factor))))
    # the halved chunk failed lately (its prefill took so many more steps that TTFT broke): half a step,
    # before the batch pays. Live near two pods' capacity, 128 -> 64 broke TTFT, and the back-off of
    # max_num_seqs that came next (16 -> 4) moved p99 ITL only 227 -> 195 ms (the chunk riding along is
    # most of a step) while the queue it built breached TTFT for the next 80 s
    gentler = (LOWER_CHUNK, k.replace(prefill_chunk_size=gentler_chunk(k.prefill_chunk_size, chunks, policy)))
    # TTFT far over while ITL has headroom: the chunk may go up two steps at once (chunk_steps); should
    # that jump have failed lately, one step is still worth a try
    jumps = {chunks.clamp(math.ceil(k.prefill_chunk_size * policy.chunk_factor ** n))
             for n in range(chunk_steps(r.ttft, policy) if r.itl <= room else 1, 0, -1)}
    larger = [(RAISE_CHUNK, k.replace(prefill_chunk_size=c)) for c in sorted(jumps, reverse=True)]
    more = (RAISE_SEQS, k.replace(max_num_seqs=policy.max_num_seqs_bounds.clamp(k.max_num_seqs + policy.seqs_step)))
    fewer = back_off_seqs(k, obs, policy)
    # requests wait for a place in the batch (and the KV cache could hold more): the cap is binding
    capped = cap_binds(k, obs, policy) and obs.kv_usage < policy.kv_pressure
    if itl_bad and not ttft_bad:
        # decode steps are slow while first tokens come in time: prefill riding along in big chunks stalls
        # them. The chunk goes first even without TTFT headroom: a back-off queues requests and costs far
        # more TTFT (0.88 -> 2.63 of its SLO in one window in benchmarks/tuning.py) than a smaller chunk
        return [smaller, gentler, fewer]
    if ttft_bad and not itl_bad:
        if r.itl <= room:
            return [more, *larger] if capped else larger  # too few places in the batch, or too many steps
        return [smaller, more] if capped else larger  # make ITL room before adding sequences
    overload = [smaller, gentler, fewer] if capped else [fewer, smaller, gentler]  # a smaller chunk costs no capacity
    queue_leads = r.ttft >= policy.severe_ratio and r.ttft > r.itl
    if new_queue and queue_leads:
        # both over, TTFT suddenly and the farther: a new load's prompts queue and stall the decodes left from
        # the last one. The queue compounds, the stall drains: less capacity would only grow the queue. Once
        # the breach outlasts a window, an overload is the likelier cause and the back-off below applies
        return ([more, *larger] if capped else larger) + overload
    # ... and should neither remedy for an overload be left (at their bounds, or failed lately), a larger
    # chunk while TTFT is severe and the farther over: holding still lets the queue compound (at a phase of
    # documents' onset chunk 256 was held for 36 s, p99 TTFT 3.7x its SLO and 14 documents waiting, while
    # 512 was free)
    return overload + (larger if queue_leads else [])


def gentler_chunk(chunk: int, bounds: KnobBounds, policy: TuningPolicy) -> int:
    """Half a chunk step down (chunk / sqrt(chunk_factor)), a multiple of 16: 128 -> 96, 256 -> 176. Taken
    only when the full step is blocked (a failure blocks its chunk and every smaller one); the next half
    step lands on the blocked chunk or below it (96 -> 64, 176 -> 128), so one half step, two for a chunk
    off the powers of two, stands between a failed halving and a back-off."""
    return bounds.clamp(max(16, round(chunk / math.sqrt(policy.chunk_factor) / 16) * 16))


def correct(s: TunerState, policy: TuningPolicy, now: float, r: Reading, moves: list[tuple[str, Knobs]],
            why: str, aimed: bool = True) -> Decision:
    """Take the first move that changes something and has not failed lately; else say why none can."""
    blocked = []
    for action, target in moves:
        if target == s.knobs:
            continue
        until = s.blocked_until(target, now, r.mix, policy.mix_factor)
        if until is None:
            if policy.mode == "auto":  # a recommendation moves nothing, so there is nothing to remember
                s = dataclasses.replace(s, failed=remember_move(s, action, target, now, policy, r))
            return move(s, policy, now, action, target, f"{why}: {r.text}", r, breached(r, s.tuned),
                        aim=AIMS[action] if aimed else None)
        blocked.append(f"{action} to {target.describe()} made things worse (retry in {until - now:.0f} s)")
    if blocked:
        tuned = Condition("False", "NoBetterSetting", f"{r.text}; " + "; ".join(blocked))
    else:
        names = ", ".join(a for a, _ in moves)
        tuned = Condition("False", "BoundsReached",
                          f"{r.text}; the correction needed ({names}) is at the bounds of {s.knobs.describe()}")
    return stay(s, now, f"{why} and no move left: {tuned.message}", r.met, tuned)


def remember_move(s: TunerState, action: str, target: Knobs, now: float, policy: TuningPolicy,
                  r: Reading) -> tuple[FailedSetting, ...]:
    """What a move teaches before it is judged. The setting a back-off leaves is a ceiling for the raises
    that follow. A move back to a setting one of the last RECENT_MOVES changes left says the moves since
    did not pay: without this, two moves that each help one p99 (a larger chunk for TTFT, a smaller one
    for ITL) would take turns, and so would three (the chunk 64 -> 32 -> 16 -> 64 -> ... in the
    simulation's impossible load, two steps down to make ITL room and a two-step jump back for TTFT).
    A chunk raise made while decodes are absent or cheap is the exception: the setting it leaves is
    `chunk_back_for_decodes`' way back for when decodes return over their ITL SLO, and the gap between
    the two conditions (under half the headroom line, over the SLO) is the hysteresis. Marked failed, the
    way back stayed blocked under the window's lagging load mix (docs/tuning.md)."""
    if action == BACK_OFF_SEQS:
        return mark_failed(s.failed, s.knobs, now, policy, RAISE_SEQS, r.mix)
    if action == RAISE_CHUNK and decodes_cheap(r, policy):
        return s.failed
    if target in s.recent_knobs and s.previous_action is not None:
        return mark_failed(s.failed, s.knobs, now, policy, s.previous_action, r.mix)
    return s.failed
