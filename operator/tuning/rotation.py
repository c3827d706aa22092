"""Which server pods a plain Service sends new requests to (a pure function; the operator labels the pods).

A Kubernetes Service spreads new connections over its ready endpoints blind to their load, so a backlog a
pod took before its peers were up (a load step, a scale-out's pods still starting) stays on it: it drains
only at what the pod's capacity leaves over its equal share of the arrivals, and the fleet's p99 TTFT is
that backlog's wait for as long as it lasts (docs/benchmarks-autoscaling.md: behind a plain Service the
fitted fleets of 4-32 pods met 70-80% of windows after convergence, behind the router 100%). The router's
least-load policy sends a pod with a longer queue nothing until it has drained to its peers' level.

Rotation does the same through the Service itself: the Service selects server pods labelled
`iterserve.io/rotation: in` (builders/labels.py; the pod template's value), and each tick the operator
relabels `out` a pod whose queue is longer than the shortest by more than what a pod finishes in one tick
(`rotation_gap`: the fleet's completions per pod times the tick, 4 requests at least), and `in` the
others. A pod out for a tick works off at most that much of its queue; one whose excess is smaller would
run dry before the next tick and idle while its peers take its share: with a gap of a fixed 4 requests,
the simulator fitted to the live pods flipped its 2 pods in and out every tick, finished half of what
they could and grew to 4 pods for a load 2 carry. The shortest queue is always in, so the Service always
has an endpoint; a pod out keeps serving what it holds (and the connections clients keep open to it:
kube-proxy balances connections, not requests). Only in tuning mode `auto` (the operator moves things on
the pods) and without spec.router (which balances by load itself); otherwise every pod is in
(operator/pod_rotation.py writes the labels).
"""

from __future__ import annotations

from collections.abc import Mapping

GAP = 4.0  # the least excess, in requests waiting, that takes a pod out of rotation


def rotation_active(tuning_mode: str, router_enabled: bool) -> bool:
    """Whether the operator takes backlogged pods out of the Service's rotation."""
    return tuning_mode == "auto" and not router_enabled


def rotation_gap(per_pod_rate: float, interval_s: float) -> float:
    """The excess over the shortest queue that takes a pod out: what a pod finishes in one tick at the
    fleet's per-pod completion rate (requests/s), `GAP` at least."""
    return max(GAP, per_pod_rate * interval_s)


def out_of_rotation(waiting: Mapping[str, float], gap: float = GAP) -> frozenset[str]:
    """The pods to keep out of rotation until the next tick, from each ready pod's requests waiting now
    (`waiting`, the pods read this tick): those whose queue is more than `gap` longer than the shortest."""
    if len(waiting) < 2:
        return frozenset()
    lo = min(waiting.values())
    return frozenset(pod for pod, w in waiting.items() if w > lo + gap)
