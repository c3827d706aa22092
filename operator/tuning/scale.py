"""The replica decision, a pure function: `decide_scale(state, fleet, policy, now) -> ScaleDecision`.

The tuner moves the knobs inside each pod; this decides how many pods there are, against the same SLO,
in the same tick. Knobs come first: the fleet grows only when the tuner has no better setting left (its
verdict is BoundsReached or NoBetterSetting, or it has just rolled a change back; in observe mode, where it
moves nothing, any confirmed breach) and the SLO is still breached, or when the waiting queue keeps growing
whatever the tuner says (arrivals outrun the fleet), or when the breach stands over a backlog the fleet is
not working off (it finishes what arrives and no more, so the queue and the breach stay). It shrinks once
the fleet has had headroom for the scale-down stabilization window (from the start of the first window that
showed it) and the load of every window since the headroom began (read within that window, those that
began inside the first aside) spread over one pod fewer would still fit with a margin, by as many pods as
that load leaves room for (at most half the fleet). `SCALE_RULES` is an ordered table like the tuner's
`RULES`: the first rule that decides wins.

What one pod can carry is learned, not configured: at each scale-out on full batches the per-pod
completion rate (the fleet saturated, or over its SLO at every knob setting) is remembered as `capacity`,
and a met window at a higher per-pod rate raises it. A scale-in must leave every pod under (1 - margin) of
it, so a fleet does not shrink back into the breach it has just grown out of.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from iterserve.operator.tuning.actions import ROLLBACK
from iterserve.operator.tuning.decision import Condition
from iterserve.operator.tuning.scale_state import (  # noqa: F401  (WindowLoad re-exported)
    SCALE_IN,
    SCALE_OUT,
    STAY,
    Fleet,
    ScaleDecision,
    ScalePolicy,
    ScaleState,
    WindowLoad,
)
from iterserve.operator.tuning.scale_tick import Tick

ScaleRule = Callable[[Tick], "ScaleDecision | None"]


def refuse_on_conflict(t: Tick) -> ScaleDecision | None:
    """Another autoscaler targets the service: two controllers writing one replica count undo each other's
    work, so this one stands aside and says which it found, and the replicas stay where they are."""
    if not t.fleet.conflicts:
        return None
    names = ", ".join(t.fleet.conflicts)
    why = (f"HorizontalPodAutoscaler {names} also targets this service; remove it or spec.autoscaling "
           f"(replicas stay at {t.n})")
    return t.stay(why, Condition("False", "HPAConflict", why), t.state)


def clamp_into_range(t: Tick) -> ScaleDecision | None:
    """Replicas outside [minReplicas, maxReplicas] (a spec edit) are brought inside at once: the range is
    the user's word and needs no window."""
    p = t.policy
    if p.min_replicas <= t.n <= p.max_replicas:
        return None
    if t.n < p.min_replicas:
        return t.scale(SCALE_OUT, p.min_replicas, f"spec.autoscaling.minReplicas is {p.min_replicas}")
    return t.scale(SCALE_IN, p.max_replicas, f"spec.autoscaling.maxReplicas is {p.max_replicas}")


def nothing_read(t: Tick) -> ScaleDecision | None:
    """No pod could be read: nothing is known about the load, so nothing moves."""
    if t.fleet.obs is not None and t.fleet.obs.num_pods > 0:
        return None
    return t.stay("no pod's metrics could be read", Condition("Unknown", "NoMetrics",
                                                              f"{t.n} replicas: no pod's metrics could be read"))


def toward_goal(t: Tick) -> ScaleDecision | None:
    """The last scale-out's evidence asked for more pods than one step may add: the next tick adds the
    next step, without waiting for the pods of the first (Kubernetes' HPA limits its rate the same way)."""
    goal = t.state.goal
    if goal is None or t.state.last_direction != SCALE_OUT or goal <= t.n:
        return None
    target = min(goal, t.step_limit(t.n))
    return t.scale(SCALE_OUT, target, f"on the way to the {goal} replicas the last scale-out's evidence asked for",
                   goal=goal)


def pods_starting(t: Tick) -> ScaleDecision | None:
    """Pods a scale-out added are still starting (loading a model takes minutes): adding more on the same
    evidence would overshoot. Waited for at most `pod_start_s`, so pods that never start (no room on the
    nodes) do not freeze the fleet."""
    st, f = t.state, t.fleet
    if (f.ready >= f.replicas or st.last_direction != SCALE_OUT or st.last_scale_time is None
            or t.now - st.last_scale_time >= t.policy.pod_start_s):
        return None
    return t.stay(f"waiting for the pods added last to start ({f.ready}/{f.replicas} ready)")


def settling(t: Tick) -> ScaleDecision | None:
    """For a window after a change (after a scale-out, after its pods came up) the observation still
    holds the fleet before it; its readings are not kept either."""
    st = t.state
    if st.last_scale_time is None:
        return None
    since = max(st.last_scale_time, t.s.whole_since or st.last_scale_time)
    if t.now - since >= t.policy.settle_s:
        return None
    left = t.policy.settle_s - (t.now - since)
    return t.stay(f"the window still holds the fleet before the last change ({left:.0f} s left)",
                  state=dataclasses.replace(st, starting=t.s.starting, whole_since=t.s.whole_since,
                                            start_s=t.s.start_s, last_queue=t.s.last_queue,
                                            queue_before=t.s.queue_before))


def backlog_draining(t: Tick) -> ScaleDecision | None:
    """The SLO is breached at the end of the knobs, but the fleet's queue is falling fast enough to be gone
    before pods asked for now could be ready (as long as the last scale-out's pods took): the breach is the
    tail of a backlog the pods are already serving, which stays on the pods that hold it, and pods that come
    up after it has drained only cost (and the per-pod rate of a fleet that is not saturated would be
    learned as its capacity). A growing queue is not draining; without a measured start time this does
    not apply."""
    s = t.s
    if (s.pressure_since is None or t.growth is not None or not (t.exhausted or t.standing) or s.start_s is None
            or t.drain is None or t.drain[1] >= s.start_s):
        return None
    rate, left = t.drain
    return t.stay(f"SLO breached, but the waiting queue falls {rate:.1f} requests/s and is gone in {left:.0f} s, "
                  f"before pods asked for now would be ready (the last took {s.start_s:.0f} s)")


def scale_out(t: Tick) -> ScaleDecision | None:
    """Pressure held for the scale-up window: add pods. A growing queue says by how much: arrivals are
    the completions plus the queue's growth, and the fleet grows in the ratio of arrivals plus what drains
    the queue within a window to completions; a standing backlog likewise, arrivals being the completions
    and the queue drained within `backlog_windows` windows (the span the standing test allows it); a breach
    at the end of the knobs by how far the worst p99 is over, or, TTFT alone over a falling queue, as a
    standing backlog (one pod at least). At most `max_factor` times the fleet or `max_step` pods more,
    whichever is more (Kubernetes' HPA's default limit)."""
    s, p, f = t.s, t.policy, t.fleet
    if s.pressure_since is None or t.now - s.pressure_since < p.scale_up_window_s:
        if s.pressure_since is not None:
            left = p.scale_up_window_s - (t.now - s.pressure_since)
            return t.stay(f"under pressure, scale-up stabilization window has {left:.0f} s left")
        return None
    n, target, why = t.n, t.n + 1, []
    if t.growth is not None:
        rate = t.seen.request_rate
        drain = t.seen.queued / p.settle_s if p.settle_s > 0 else 0.0
        target = max(target, _grown(n, rate, rate + t.growth + drain, p.max_replicas))
        why.append(f"the waiting queue grew {t.growth:.2f} requests/s over {p.queue_windows} back-to-back windows "
                   f"while {rate:.2f} requests/s finished")
    rate, backlog = t.seen.request_rate, t.seen.queued / (p.backlog_windows * p.settle_s)
    if t.standing and t.growth is None:
        target = max(target, _grown(n, rate, rate + backlog, p.max_replicas))
        trend = "not falling" if t.drain is None else f"falling {t.drain[0]:.1f} requests/s"
        why.append(f"SLO breached with {t.seen.queued:.0f} requests waiting, {trend}, while {rate:.2f} requests/s "
                   f"finished")
    if t.exhausted:
        reading = f.reading
        assert reading is not None  # exhausted only on a reading
        verdict = f.verdict.reason if not f.knobs_fixed else 'observe mode'
        why.append(f"SLO breached with no better knob setting ({verdict}"
                   f"{', rolled back' if f.tuner_action == ROLLBACK else ''}): {reading.text}")
        if t.drain is not None and reading.itl <= 1:
            # TTFT alone over a falling queue: the window's p99 is the backlog's wait, which pods added now
            # shorten only by draining it sooner, so they are sized as a standing backlog's are
            target = max(target, _grown(n, rate, rate + backlog, p.max_replicas))
            why.append(f"the queue falling {t.drain[0]:.1f} requests/s: sized to drain it within "
                       f"{p.backlog_windows:g} windows")
        else:
            target = max(target, n + math.ceil(n * (min(reading.score, p.max_factor) - 1)))
    goal, target = min(target, p.max_replicas), min(target, t.step_limit(n))
    reason = "; ".join(why)
    if target <= n:
        reason = f"at spec.autoscaling.maxReplicas ({n}) and still {reason}"
        return t.stay(reason, Condition("False", "MaxReplicasReached", f"{n} replicas: {reason}"))
    return t.scale(SCALE_OUT, target, reason + (f" (on the way to {goal})" if goal > target else ""),
                   capacity=t.per_pod_rate if t.per_pod_rate > 0 and t.full else None, goal=goal)


def _grown(n: int, done: float, wanted: float, most: int) -> int:
    """n pods finish `done` requests/s and `wanted` are asked of them: the pods that finish it (a rate near
    zero asks for the most the range allows, one more at least)."""
    if done <= 0:
        return n + 1
    return math.ceil(min(n * wanted / done, float(max(most, n + 1))))


def scale_in(t: Tick) -> ScaleDecision | None:
    """Headroom held for the scale-down window, and the load over one pod fewer still fits (`_overfull`; the
    load is `Tick.load`, the highest since the headroom began).
    Then as many pods go as the same test allows, at most `max_in_share` of the fleet: a fleet grown for a
    peak would otherwise spend a window per idle pod on its way back (28 -> 4 pods took 8 minutes in the
    fitted simulator), where Kubernetes' HPA goes to its recommendation in one step."""
    s, p = t.s, t.policy
    n = t.n
    if s.headroom_since is None or n <= p.min_replicas:
        return None
    if t.now - s.headroom_since < p.scale_down_window_s:
        left = p.scale_down_window_s - (t.now - s.headroom_since)
        return t.stay(f"headroom, scale-down stabilization window has {left:.0f} s left")
    if (why := _overfull(t, n - 1)) is not None:
        return t.stay(f"headroom, but {why}")
    fewest = max(p.min_replicas, n - max(1, math.floor(n * p.max_in_share)))
    m = next(m for m in range(fewest, n) if _overfull(t, m) is None)
    fits = f"{t.load[0] / m:.2f} requests/s per pod over {m} pod{'s' if m > 1 else ''}" + (
        f" within {1 - p.margin:.0%} of the {s.capacity:.2f} one pod carries" if s.capacity is not None else "")
    return t.scale(SCALE_IN, m, f"headroom for {p.scale_down_window_s:.0f} s and {fits}")


def _overfull(t: Tick, m: int) -> str | None:
    """Why the load over `m` pods would not fit, or None when it would: each pod's requests per second under
    (1 - margin) of the capacity learned at the last scale-out or, none known under the knobs in force, not
    over the most a pod was seen to carry within the SLO (a pod carries its last fraction of a request per
    second at a steep price in queueing that the window before does not show: fitted pods at a quarter of
    the TTFT SLO breached at one pod fewer, 1.17x that rate); its requests in flight under (1 - margin) of
    the batch cap."""
    s, p, f = t.s, t.policy, t.fleet
    fit, pods = 1 - p.margin, f"{m} pod{'s' if m > 1 else ''}"
    rate, busy = t.load[0] / m, t.load[1] / m
    if s.capacity is not None and rate > fit * s.capacity:
        return (f"{rate:.2f} requests/s per pod over {pods} would pass {fit:.0%} of the {s.capacity:.2f} one "
                f"pod carries within the SLO")
    if s.capacity is None and s.proven is not None and rate > s.proven:
        return (f"{rate:.2f} requests/s per pod over {pods} is more than the {s.proven:.2f} a pod has been seen "
                f"to carry within the SLO")
    if f.batch_cap and busy > fit * f.batch_cap:
        return f"{busy:.1f} requests in flight per pod over {pods} would pass {fit:.0%} of max_num_seqs {f.batch_cap}"
    return None


def hold(t: Tick) -> ScaleDecision:
    """The table's last rule: it always decides."""
    if t.headroom and t.n <= t.policy.min_replicas:
        return t.stay("headroom at spec.autoscaling.minReplicas")
    return t.stay("the SLO is met without headroom to spare" if t.fleet.reading is None or t.fleet.reading.met
                  else "the tuner is still correcting the breach with the knobs")


SCALE_RULES: tuple[ScaleRule, ...] = (
    refuse_on_conflict, clamp_into_range, nothing_read, toward_goal, pods_starting, settling, backlog_draining,
    scale_out, scale_in, hold,
)


def decide_scale(state: ScaleState, fleet: Fleet, policy: ScalePolicy, now: float) -> ScaleDecision:
    t = Tick(state, fleet, policy, now)
    for rule in SCALE_RULES:
        if (decision := rule(t)) is not None:
            return decision
    raise AssertionError("hold always decides")
