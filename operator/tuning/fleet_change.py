"""`scale_out_in_flight`: whether pods a scale-out asked for are still coming up under the tuner, or
draining the backlog gathered before them (pure).

A backlog at a rising load is both a breach for the tuner and growth for the scaler. Once the scaler has
added pods, halving max_num_seqs (the tuner's cure for both p99s over) cuts what the pods carry just when
the fleet is growing to carry more: live, a pod with 41 requests waiting went from 16 to 6 places while
its peer started, the queue grew to 53, and the SLO was met 3 minutes into the peak instead of 1.5
(docs/benchmarks-autoscaling.md). So while a scale-out's pods are starting, for a window after they
all are ready (the scaler's own `settling`), and after that while the waiting queue still falls (the
backlog gathered before the new pods came up, drained by a fleet that now carries more than arrives:
another live run backed off on the first window after the settling, 40 requests still waiting), the
tuner does not back max_num_seqs off for a breach (decide.py's `cure_breach`); preemptions still back it
off. Both the operator (operator/tuning_loop.py) and the simulator (benchmarks/autoscaling.py) call this
before the tuner's tick.
"""

from __future__ import annotations

from iterserve.operator.tuning.scale_state import SCALE_OUT, ScalePolicy, ScaleState


def scale_out_in_flight(state: ScaleState, replicas: int, ready: int, policy: ScalePolicy,
                        now: float) -> str | None:
    """What the last scale-out is waiting for, or None when there is none in flight. `replicas` and `ready`
    are the Deployment's now; `state` is the scaler's after its last tick (it learns that the pods are all
    ready at its next tick, which comes after the tuner's: `ready` says it first)."""
    last = state.last_scale_time
    if last is None or state.last_direction != SCALE_OUT:
        return None
    if state.starting and ready < replicas:
        if now - last >= policy.pod_start_s:
            return None  # pods that never start must not hold the tuner back (the scaler gives up on them too)
        return f"pods the autoscaler added are starting ({ready}/{replicas} ready)"
    whole = now if state.starting else (state.whole_since or last)
    left = policy.settle_s - (now - max(last, whole))
    if left > 0:
        return f"the {replicas} replicas the autoscaler grew to are settling ({left:.0f} s left)"
    # the scaler's last two readings (its settling keeps them too), up to its last tick
    a, b = state.queue_before, state.last_queue
    if a is None or b is None or a[0] <= last or now - last >= policy.pod_start_s:
        return None
    if not a[1] > b[1] >= max(1.0, 0.5 * replicas):
        return None  # the backlog is gone, or the queue grows again: an overload of the new fleet
    return f"the {replicas} replicas the autoscaler grew to are draining the backlog ({a[1]:.0f} -> {b[1]:.0f} waiting)"
