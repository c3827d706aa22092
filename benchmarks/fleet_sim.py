"""The fleet of benchmarks/autoscaling.py: pods of the tuning tests' latency model behind the routing the
product has, a new pod ready a fixed time after it is asked for, a removed pod's queue going to the others.

Two routings, one per way a service is reached:
- `round-robin`: a plain Kubernetes Service (kube-proxy picks a ready endpoint per connection, blind to
  load): every ready pod gets the same share of the arrivals, so a backlog a pod took before its peers
  were ready stays on it and drains only at what its capacity has left over its share.
- `least-load`: `spec.router` with its default policy (router/policy.py's `LeastLoad`: the pod with the
  fewest waiting + running requests). As a fluid: a pod whose queue is longer than its peers' gets no new
  arrivals until it has drained to their level, then an even share; when the whole fleet is over
  capacity, arrivals keep the queues level (water-filling).
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.operator.tuning.knobs import Knobs
from iterserve.operator.tuning.observation import Observation
from tests.tuning_latency_model import LatencyModel

ROUTINGS = ("round-robin", "least-load")


@dataclass
class Pod:
    model: LatencyModel
    ready_at: float


def even(backlogs: list[float], capacity: float, rate: float, dt: float) -> list[float]:
    """Round-robin: the same share for every pod, whatever its queue."""
    return [rate / len(backlogs)] * len(backlogs)


def least_load(backlogs: list[float], capacity: float, rate: float, dt: float) -> list[float]:
    """Each pod's arrival rate over one window of `dt` s under least-load routing, pods of equal
    `capacity` (requests/s; the knobs are the fleet's) holding `backlogs` requests beyond their steady
    state at its start. If the fleet can absorb the window's arrivals without any queue ending above zero,
    a pod takes an even share of them for the part of the window after its own backlog has drained
    (none while it is the longest queue). Otherwise the queues end level at the height L where the rates
    `capacity + (L - backlog) / dt` (never below zero) add up to the arrivals."""
    free = [max(0.0, 1.0 - b / (capacity * dt)) for b in backlogs]  # the share of the window each is drained
    if sum(free) > 0 and rate / sum(free) <= capacity:
        return [rate * f / sum(free) for f in free]
    lo, hi = 0.0, max(backlogs) + rate * dt
    for _ in range(60):  # bisection on the level: the total is increasing in it
        mid = (lo + hi) / 2
        total = sum(max(0.0, capacity + (mid - b) / dt) for b in backlogs)
        lo, hi = (mid, hi) if total < rate else (lo, mid)
    return [max(0.0, capacity + (hi - b) / dt) for b in backlogs]


ROUTE = {"round-robin": even, "least-load": least_load}


class FleetSim:
    """Pods of the latency model behind `routing` (one of ROUTINGS)."""

    def __init__(self, replicas: int, seed: int, start_s: float, routing: str = "round-robin"):
        self.seed, self.start_s, self.made, self.route = seed, start_s, 0, ROUTE[routing]
        self.pods = [self._pod(-1.0) for _ in range(replicas)]

    def _pod(self, ready_at: float) -> Pod:
        self.made += 1
        return Pod(LatencyModel(seed=self.seed * 1000 + self.made), ready_at)

    def resize(self, replicas: int, now: float) -> None:
        while len(self.pods) < replicas:
            self.pods.append(self._pod(now + self.start_s))
        while len(self.pods) > replicas:  # the newest goes first (a ReplicaSet prefers unready, young pods)
            gone = self.pods.pop()
            ready = [p for p in self.pods if p.ready_at <= now] or self.pods
            for p in ready:
                p.model.backlog += gone.model.backlog / len(ready)

    def window(self, knobs: Knobs, rate: float, start: float, end: float) -> Observation:
        """The fleet's window as the operator reads it from every ready pod's /metrics: rates and queues
        summed, p99s the worst pod's."""
        ready = [p for p in self.pods if p.ready_at <= start]
        capacity = ready[0].model.steady(knobs, rate / len(ready)).capacity  # one model, one setting: equal
        rates = self.route([p.model.backlog for p in ready], capacity, rate, end - start)
        obs = [p.model.window(knobs, r, start, end) for p, r in zip(ready, rates)]
        return Observation(
            start=start, end=end, num_pods=len(obs), num_samples=sum(o.num_samples for o in obs),
            ttft_p99_s=max(o.ttft_p99_s for o in obs), itl_p99_s=max(o.itl_p99_s for o in obs),
            request_rate=sum(o.request_rate for o in obs), prompt_token_rate=sum(o.prompt_token_rate for o in obs),
            generation_token_rate=sum(o.generation_token_rate for o in obs), waiting=sum(o.waiting for o in obs),
            running=sum(o.running for o in obs), queue_time_mean_s=max(o.queue_time_mean_s for o in obs),
            kv_usage=max(o.kv_usage for o in obs), preemption_rate=sum(o.preemption_rate for o in obs),
            error_rate=0.0)

    def ready(self, now: float) -> int:
        return sum(p.ready_at <= now for p in self.pods)
