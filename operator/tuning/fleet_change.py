"""`scale_out_in_flight`: whether pods a scale-out asked for are still coming up under the tuner, or
draining the backlog gathered before them (pure).

A backlog at a rising load is both a breach for the tuner and growth for the scaler. Once the scaler has
added pods, halving max_num_seqs (the tuner's cure for both p99s over) cuts what the pods carry just when
the fleet is growing to carry more: live, a pod with 41 requests waiting went from 16 to 6 places while
its peer started, the queue grew to 53, and the SLO was met 3 minutes into the peak instead of 1.5
(docs/benchmarks-autoscaling.md). So while a scale-out's pods are starting, for a window after they
all are ready (the scaler's own `settling`), and after that while the waiting queue still falls from the
scaler's last reading to the tuner's at its tick (`ScaleOut.seen`; the backlog gathered before the new
pods came up, drained by a fleet that now carries more than arrives:
another live run backed off on the first window after the settling, 40 requests still waiting), the
tuner does not back max_num_seqs off for a breach (decide.py's `cure_breach`); preemptions still back it
off. Once the pods are all ready (`ScaleOut.ready`: settling, then draining), a TTFT breach is mostly the
backlog's (requests queued before the new pods came up, which the grown fleet is already clearing), and
a larger chunk, which buys TTFT with ITL, is not a cure for it either: live, a tuner that raised the
chunk 64 -> 128 on p99 TTFT 1.33x its SLO, the queue falling 34 -> 6, undid the smaller chunk that had
cured ITL, and the next window breached ITL (222 ms against 205); the round's other run, its backlog
gone a window sooner, kept 64 and met both. Another raised it 64 -> 256 in the settling window (TTFT
3.1x, ITL 160 ms against 216), breached ITL (391 ms) and took two windows coming back to 64. Nor is it
while the pods start and ITL is over its SLO as well: in three live runs out of three, the tuner raised
the chunk 128 -> 256 (p99 ITL 1.14-2.0x its SLO) in the seconds the second pod took to start, came back
to 128 a window later, ITL worse, and only then went on to 64. With ITL within its SLO the raise is
TTFT's cure while pods start (the simulator's, 60 s to start, need it). More places where the cap binds
add throughput and still are.

Both the operator (operator/tuning_loop.py) and the simulator (benchmarks/autoscaling.py) call this before
the tuner's tick. A scale-out the scaler decides on the tuner's own window (it ticks after the tuner) is
not in flight yet; `second_look` decides the tuner's move again as if it were, before it is applied.

A fleet sized outside the operator (an HPA or KEDA on the scale subresource, a person) grows the same way
and the tuner would back off the same way: live, the HPA's runs lost a window each to a back-off while
the HPA's second pod started or drained the backlog. `OutsideScale` follows such a fleet from its replica
count alone, keeping the scaler's bookkeeping as if the scaler had made the change, so that the same rule
holds the back-off there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from iterserve.operator.tuning.actions import HOLD
from iterserve.operator.tuning.decision import Decision
from iterserve.operator.tuning.scale_state import SCALE_IN, SCALE_OUT, ScalePolicy, ScaleState

AUTOSCALER, OUTSIDE = "the autoscaler", "outside the operator"  # who made the scale-out, for the reason


@dataclass(frozen=True)
class ScaleOut:
    """A scale-out in flight, as the tuner is told of it: what it waits for (`why`, its str) and whether its
    pods are all ready (settling, or draining the backlog gathered before them) rather than starting.
    After the settling it is a drain only while the queue falls: `drain_from` is the scaler's last reading
    of requests waiting, and `seen` compares the tuner's own reading at its tick with it."""

    why: str
    ready: bool = False
    drain_from: float | None = None
    floor: float = 1.0  # fewer waiting than this is no backlog left to drain

    def __str__(self) -> str:
        return self.why

    def seen(self, queued: float) -> ScaleOut | None:
        """This scale-out for a tuner that reads `queued` requests waiting now: a drain holds only while the
        queue is below the scaler's last reading (5 s before, a tick of the live cadence) and still a
        backlog. The scaler's own last two readings are a tick older than the tuner's: live, they said
        21.7 -> 22.0 waiting while the tuner read 18.1, and the larger chunk the drain holds back went up."""
        if self.drain_from is None:
            return self
        if not self.drain_from > queued >= self.floor:
            return None  # the backlog is gone, or the queue grows again: an overload of the new fleet
        return ScaleOut(f"{self.why} ({self.drain_from:.0f} -> {queued:.0f} waiting)", ready=True)


def told(scale_out: ScaleOut | None, queued: float | None) -> ScaleOut | None:
    """What the tuner is told of `scale_out` at its tick, `queued` requests waiting in its window (None: no
    window read): a drain as that queue has it (`ScaleOut.seen`)."""
    return scale_out if scale_out is None or queued is None else scale_out.seen(queued)


def second_look(decision: Decision, in_flight: ScaleOut | None, queued: float | None,
                redecide: Callable[[ScaleOut], Decision], scales_out: Callable[[Decision], bool]) -> Decision:
    """The tuner's `decision` once the scaler's on the same window is known. The scaler ticks after the
    tuner, on what the tuner did, so a scale-out it decides on this window is in no `in_flight` yet: a move
    the fleet would grow on (`scales_out`) is decided again (`redecide`) as if the new pods were starting,
    and that decision is kept when it differs and the fleet still grows on it. Live, the tuner
    raised the chunk 128 -> 256 (p99 TTFT 1.51x, ITL 1.13x) on the window the scaler added a pod on for a
    growing queue: ITL went to 445-486 ms and three windows were lost."""
    if told(in_flight, queued) is not None or decision.action == HOLD or decision.knobs is None:
        return decision
    if not scales_out(decision):
        return decision
    again = redecide(ScaleOut(f"pods {AUTOSCALER} adds on this window are about to start"))
    return again if again.knobs != decision.knobs and scales_out(again) else decision


def scale_out_in_flight(state: ScaleState, replicas: int, ready: int, policy: ScalePolicy,
                        now: float, who: str = AUTOSCALER) -> ScaleOut | None:
    """What the last scale-out is waiting for, or None when there is none in flight. `replicas` and `ready`
    are the Deployment's now; `state` is the scaler's after its last tick (it learns that the pods are all
    ready at its next tick, which comes after the tuner's: `ready` says it first). After the settling, the
    drain it returns holds only as `ScaleOut.seen` finds it against the tuner's reading (`decide` does).
    `who` made it, for the reason: AUTOSCALER (spec.autoscaling) or OUTSIDE (`OutsideScale`)."""
    added, grew = (f"pods {who} added", f"the {replicas} replicas {who} grew to") if who == AUTOSCALER else \
        (f"pods added {who}", f"the {replicas} replicas the fleet grew to {who}")
    last = state.last_scale_time
    if last is None or state.last_direction != SCALE_OUT:
        return None
    if state.starting and ready < replicas:
        if now - last >= policy.pod_start_s:
            return None  # pods that never start must not hold the tuner back (the scaler gives up on them too)
        return ScaleOut(f"{added} are starting ({ready}/{replicas} ready)")
    whole = now if state.starting else (state.whole_since or last)
    left = policy.settle_s - (now - max(last, whole))
    if left > 0:
        return ScaleOut(f"{grew} are settling ({left:.0f} s left)", ready=True)
    # the scaler's last reading (its settling keeps it too), up to its last tick: the tuner's own at its
    # tick says whether the queue still falls (`ScaleOut.seen`)
    b = state.last_queue
    if b is None or b[0] <= last or now - last >= policy.pod_start_s:
        return None
    return ScaleOut(f"{grew} are draining the backlog", ready=True, drain_from=b[1], floor=max(1.0, 0.5 * replicas))


@dataclass(frozen=True)
class OutsideScale:
    """A fleet whose replica count is set outside the operator, followed tick by tick: the count last seen
    and the scaler's bookkeeping (`ScaleState`) as if it had made each change, for `scale_out_in_flight`.
    `see` comes before the tuner's tick (a new count is a scale-out or a scale-in; all ready ends the
    start), `queue` after it with the window's requests waiting, as the scaler's own tick records them."""

    replicas: int | None = None
    state: ScaleState = field(default_factory=ScaleState)

    def see(self, replicas: int, ready: int, now: float) -> OutsideScale:
        st = self.state
        if self.replicas is not None and replicas != self.replicas:
            out = replicas > self.replicas
            st = dataclasses.replace(st, last_scale_time=now, last_direction=SCALE_OUT if out else SCALE_IN,
                                     starting=out, whole_since=None if out else st.whole_since)
        if st.starting and ready >= replicas:
            st = dataclasses.replace(st, starting=False, whole_since=now)
        return OutsideScale(replicas, st)

    def queue(self, queued: float, now: float) -> OutsideScale:
        return dataclasses.replace(self, state=dataclasses.replace(self.state, last_queue=(now, queued)))

    def in_flight(self, ready: int, window_s: float, now: float) -> ScaleOut | None:
        """`scale_out_in_flight` for the count last seen (`see` it this tick first): pods settle over the
        tuner's window `window_s`, and are not waited for past the scaler's default `pod_start_s`."""
        if self.replicas is None:
            return None
        policy = ScalePolicy(min_replicas=1, max_replicas=max(1, self.replicas), settle_s=window_s,
                             window_s=window_s)
        return scale_out_in_flight(self.state, self.replicas, ready, policy, now, OUTSIDE)
