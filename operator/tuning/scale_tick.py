"""What one call of `decide_scale` knows: its inputs, and what the replica rules (scale.py) derive from
them, each computed once: the queue's growth and drain, a standing backlog, pressure and headroom, the
load a scale-in must fit, and the state with this tick's bookkeeping."""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property
from typing import Any

from iterserve.operator.tuning.actions import ROLLBACK
from iterserve.operator.tuning.decision import Condition
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.queue_trend import back_to_back, recent
from iterserve.operator.tuning.scale_state import (
    EXHAUSTED,
    SCALE_IN,
    SCALE_OUT,
    STAY,
    Fleet,
    ScaleDecision,
    ScalePolicy,
    ScaleState,
    WindowLoad,
)


class Tick:
    """One call's inputs and what the rules derive from them, each computed once."""

    def __init__(self, state: ScaleState, fleet: Fleet, policy: ScalePolicy, now: float):
        self.state, self.fleet, self.policy, self.now = state, fleet, policy, now

    @property
    def n(self) -> int:
        return self.fleet.replicas

    @property
    def seen(self) -> Observation:
        """The window's observation, for the rules that act on pressure or headroom (only an observed
        window sets either)."""
        assert self.fleet.obs is not None
        return self.fleet.obs

    @cached_property
    def partial(self) -> bool:
        """The window is under half the tuner's (it starts afresh at a knob change and when the pods are
        first read): a queue averaged over a few seconds is a handful of arrivals, and over a load's first
        seconds it rises from empty as the pipeline fills, which is not growth."""
        obs = self.fleet.obs
        return obs is not None and obs.window_s < 0.5 * self.policy.window_s

    @cached_property
    def queue(self) -> tuple[tuple[float, float], ...]:
        """The fleet's queue readings of the last few windows, this one included unless `partial`."""
        obs = self.fleet.obs
        if obs is None or self.partial:
            return self.state.queue
        return recent(self.state.queue, self.now, obs.queued, obs.window_s, self.policy.queue_windows)

    @cached_property
    def chain(self) -> tuple[tuple[float, float], ...]:
        """The readings growth is judged on: this one and those of the windows back to back before it."""
        obs = self.fleet.obs
        if obs is None or self.partial:
            return ()
        return back_to_back(self.queue, obs.start, obs.window_s, self.policy.queue_windows)

    @cached_property
    def growth(self) -> float | None:
        """Requests added to the fleet's queue per second over the `chain`, when it is `queue_windows` long,
        each reading higher than the one before, the last at least half a request per pod and the growth at
        least `queue_growth` of the completions (arrivals outrun the fleet, not a noisy gauge); else None."""
        q, p = self.chain, self.policy
        if (len(q) < p.queue_windows or any(b[1] <= a[1] for a, b in zip(q, q[1:], strict=False))
                or q[-1][1] < max(1.0, 0.5 * self.n)):
            return None
        growth = (q[-1][1] - q[0][1]) / max(q[-1][0] - q[0][0], 1e-9)
        return growth if growth >= p.queue_growth * self.seen.request_rate else None  # a chain needs a window

    @cached_property
    def drain(self) -> tuple[float, float] | None:
        """(requests/s, seconds left) at which the fleet's queue has fallen since the previous reading and
        would be empty, when it has fallen; else None. Judged on the previous reading whatever the fleet
        was then: a falling queue is a fact, where growth (`growth`) needs readings of this fleet."""
        before, obs = self.state.last_queue, self.fleet.obs
        if before is None or obs is None or obs.queued >= before[1] or self.now <= before[0]:
            return None
        rate = (before[1] - obs.queued) / (self.now - before[0])
        return rate, obs.queued / rate

    @cached_property
    def standing(self) -> bool:
        """The SLO is breached over a backlog the fleet is not working off: at least half a request per pod
        waiting, not fallen since the previous reading or falling too slowly to be gone within
        `backlog_windows` windows. A fleet that finishes what arrives and no more keeps its backlog, and the
        breach with it, whatever the knobs do to the batch; pods added drain it (least-load sends them the
        new requests while the backlog's pods work it off)."""
        f, r, p = self.fleet, self.fleet.reading, self.policy
        if r is None or r.met or f.obs is None or self.state.last_queue is None:
            return False
        if f.obs.queued < max(1.0, 0.5 * self.n):
            return False
        return self.drain is None or self.drain[1] >= p.backlog_windows * p.settle_s

    @cached_property
    def exhausted(self) -> bool:
        """The SLO is breached and the knobs have nothing better to give."""
        f, r = self.fleet, self.fleet.reading
        if r is None or r.met:
            return False
        if f.knobs_fixed:
            return f.verdict.status == "False"
        return (f.verdict.status == "False" and f.verdict.reason in EXHAUSTED) or f.tuner_action == ROLLBACK

    @cached_property
    def headroom(self) -> bool:
        """The SLO met with TTFT under the headroom line and next to nothing waiting, or a quiet fleet (too
        few requests to measure, none waiting). TTFT is what queueing moves as the load per pod grows;
        ITL moves mostly with the knobs (the chunk riding along), so it must only be met: whether one pod
        fewer would still fit is `scale_in`'s capacity test. Requests waiting are counted, not only weighed
        through TTFT (the reading's drain): a fleet whose batches are full is not at ease, whatever its p99
        (judged on TTFT alone, `headroom on latency alone` in benchmarks/autoscaling_whatif.py, the fitted
        fleets came out within 2%)."""
        f = self.fleet
        if f.obs is None or f.obs.queued >= 0.5 * max(f.replicas, 1) or f.obs.preemption_rate > 0:
            return False
        if f.reading is None:
            return True
        r = f.reading
        return r.met and r.ttft <= self.policy.headroom_line and r.trouble is None

    @cached_property
    def per_pod_rate(self) -> float:
        """Requests per second each pod read finished."""
        obs = self.fleet.obs
        return obs.request_rate / obs.num_pods if obs is not None and obs.num_pods else 0.0

    @cached_property
    def full(self) -> bool:
        """The pods ran full batches on average (or the batch cap is not known): only then is the per-pod
        completion rate what a pod carries. A breach held up by one pod's backlog, with its peers idle
        (round-robin leaves a step's excess on the pod that took it), is not: learned as capacity, that
        rate would keep the fleet from shrinking to what the load needs."""
        obs, cap = self.fleet.obs, self.fleet.batch_cap
        return obs is None or not cap or obs.in_batch >= self.policy.full_batch * cap * max(obs.num_pods, 1)

    @cached_property
    def s(self) -> ScaleState:
        """The state with this tick's bookkeeping: the queue reading, since when pressure or headroom has
        held, and the capacity a met window at a higher per-pod rate proves."""
        st, f, now = self.state, self.fleet, self.now
        st = dataclasses.replace(st, queue=self.queue)
        if st.starting and f.ready >= f.replicas:
            took = now - st.last_scale_time if st.last_scale_time is not None else None
            st = dataclasses.replace(st, starting=False, whole_since=now, start_s=took)
        if f.obs is None:
            return st
        st = dataclasses.replace(st, last_queue=(now, f.obs.queued), queue_before=st.last_queue)
        pressure = self.exhausted or self.growth is not None or self.standing
        capacity = st.capacity
        if capacity is not None and st.capacity_knobs != f.knobs:
            capacity = None  # the tuner has moved the knobs since: what one pod carries is known no more
        met = f.reading is not None and f.reading.met and f.reading.trouble is None
        if capacity is not None and met and self.per_pod_rate > capacity:
            capacity = self.per_pod_rate
        proven = max(st.proven or 0.0, self.per_pod_rate) if met else st.proven
        kept = tuple(x for x in st.loads if x.read_at > now - self.policy.scale_down_window_s)
        if not self.partial:
            kept = (*kept, WindowLoad(now, f.obs.start, f.obs.request_rate, f.obs.in_batch + f.obs.queued))
        headroom_since = None
        if self.headroom:
            headroom_since = self.window_start if st.headroom_since is None else st.headroom_since
        return dataclasses.replace(
            st, capacity=capacity, proven=proven, loads=kept, capacity_knobs=f.knobs if capacity is not None else None,
            pressure_since=(st.pressure_since if st.pressure_since is not None else now) if pressure else None,
            headroom_since=headroom_since)

    @cached_property
    def load(self) -> tuple[float, float]:
        """(requests/s finished, requests in flight): the highest of this window's and those of the windows
        read within the scale-down window that started once the first one that showed headroom was over. A
        scale-in must fit all of them, as Kubernetes' HPA scales in only to the highest recommendation of its
        window: a fleet at ease through a peak (grown past it to drain a backlog) would otherwise shrink to
        the first window of a dip, which its first seconds cannot tell from a step down (the fitted
        simulator's peak with 30-s dips lost windows to it). The windows that began inside the first one are
        left out: where the load fell inside it, their completions are mostly the load before (live, windows
        read every 5 s that straddled the step down kept the second pod 19–25 s past the headroom's wait);
        where the load held, the windows after it show the same."""
        obs, since = self.seen, self.s.headroom_since
        rows = [x for x in self.s.loads if since is not None and x.start >= since + self.policy.window_s]
        return (max([obs.request_rate] + [x.rate for x in rows]),
                max([obs.in_batch + obs.queued] + [x.in_flight for x in rows]))

    @property
    def window_start(self) -> float:
        """Since when the window's figures hold: its start, not before the last change of the fleet. Headroom
        is timed from there: the window that first shows it measured it over all its length, and timed from
        its end, a pod stayed a window longer after every peak (live, with a 60-s scale-down window, the
        second pod went 81-102 s after the load fell; timed from the start, 56 s)."""
        start = self.seen.start
        return start if self.state.last_scale_time is None else max(start, self.state.last_scale_time)

    def step_limit(self, n: int) -> int:
        p = self.policy
        return min(max(math.floor(n * p.max_factor), n + p.max_step), p.max_replicas)

    def scale(self, action: str, target: int, reason: str, capacity: float | None = None,
              goal: int | None = None) -> ScaleDecision:
        # headroom outlives a scale-in (the next one needs only a window measured after it, and the load
        # to fit one pod fewer again), not a scale-out
        learned: dict[str, Any] = {} if capacity is None else {"capacity": capacity, "capacity_knobs": self.fleet.knobs}
        st = dataclasses.replace(self.s, last_scale_time=self.now, last_direction=action, pressure_since=None,
                                 headroom_since=self.s.headroom_since if action == SCALE_IN else None,
                                 queue=(), starting=action == SCALE_OUT,
                                 goal=goal if goal is not None and goal > target else None, **learned)
        why = f"{self.n} -> {target} replicas: {reason}"
        return ScaleDecision(action, target, why, Condition("True", "ScaledOut" if action == SCALE_OUT
                                                            else "ScaledIn", why), st)

    def stay(self, reason: str, condition: Condition | None = None, state: ScaleState | None = None) -> ScaleDecision:
        condition = condition or Condition("True", "Steady", f"{self.n} replicas: {reason}")
        return ScaleDecision(STAY, self.n, reason, condition, self.s if state is None else state)
