"""Which server pods a plain Service sends new requests to (a pure function; the operator labels the pods).

A Kubernetes Service spreads new connections over its ready endpoints blind to their load, so a backlog a
pod took before its peers were up (a load step, a scale-out's pods still starting) stays on it: it drains
only at what the pod's capacity leaves over its equal share of the arrivals, and the fleet's p99 TTFT is
that backlog's wait for as long as it lasts (docs/benchmarks-autoscaling.md: behind a plain Service the
fitted fleets of 4-32 pods met 70-80% of windows after convergence, behind the router 100%). The router's
least-load policy sends a pod with a longer queue nothing until it has drained to its peers' level.

Rotation does the same through the Service itself: the Service selects server pods labelled
`iterserve.io/rotation: in` (builders/labels.py; the pod template's value), and the operator relabels a
pod `out` while its queue is `gap` requests longer than the shortest, and `in` again once it is within
half of that (so a pod at the edge does not flip every tick). The shortest queue is always in, so the
Service always has an endpoint; a pod out keeps serving what it holds (and the connections clients keep
open to it: kube-proxy balances connections, not requests). Only in tuning mode `auto` (the operator
moves things on the pods) and without spec.router (which balances by load itself); otherwise every pod
is in (operator/pod_rotation.py writes the labels).
"""

from __future__ import annotations

from collections.abc import Mapping, Set

GAP = 4.0  # requests waiting beyond the shortest queue that take a pod out of rotation


def rotation_active(tuning_mode: str, router_enabled: bool) -> bool:
    """Whether the operator takes backlogged pods out of the Service's rotation."""
    return tuning_mode == "auto" and not router_enabled


def out_of_rotation(waiting: Mapping[str, float], out: Set[str], gap: float = GAP) -> frozenset[str]:
    """The pods to keep out of rotation, from each ready pod's requests waiting now (`waiting`, pods read
    this tick) and those out now (`out`): a pod in goes out when its queue is more than `gap` longer than
    the shortest, a pod out comes back once it is within `gap / 2`."""
    if len(waiting) < 2:
        return frozenset()
    lo = min(waiting.values())
    return frozenset(pod for pod, w in waiting.items() if w > lo + (gap / 2 if pod in out else gap))
