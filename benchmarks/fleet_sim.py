"""The fleet of benchmarks/autoscaling.py: pods of the tuning tests' latency model behind the routing the
product has, a new pod ready a fixed time after it is asked for, a removed pod's queue going to the others.

Two routings, one per way a service is reached:
- `round-robin`: a plain Kubernetes Service (kube-proxy picks a ready endpoint per connection, blind to
  load) with the operator's rotation (operator/tuning/rotation.py, in tuning mode auto without
  spec.router): every tick the operator takes out of the Service's endpoints each pod whose queue is
  longer than the shortest by more than what a pod finishes in a tick (`rotation_gap`: here the last
  tick's completions per pod, 4 requests at least), and puts the others in; the pods in rotation get the
  same share of the arrivals, a pod out none (it keeps serving its queue). Here
  the queue it reads is a pod's backlog (requests beyond its steady state: pods of one model at the same
  knobs and share differ only by it) at the window's start, as the operator reads the gauge once a tick.
  With `rotation=False`, a plain Service alone: every ready pod the same share, so a backlog a pod took
  before its peers were ready stays on it and drains only at what its capacity has left over its share.
- `least-load`: `spec.router` with its default policy (router/policy.py's `LeastLoad`: the pod with the
  least work ahead, prompt tokens to prefill and requests; a fluid of equal requests has no prompt of its
  own, so here the queue alone). As a fluid: a pod whose queue is longer than its peers' gets no new
  arrivals until it has drained to their level, then an even share; when the whole fleet is over
  capacity, arrivals keep the queues level (water-filling). The operator does not rotate behind it.

The fleet's p99s are what the operator computes (operator/tuning/observe.py): the quantile of the pods'
histograms summed, not the worst pod's p99 (`--fleet-p99 worst-pod` keeps that older, harsher reading for
comparison: the maximum of F noisy p99s grows with F where the summed histogram's does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.rotation import out_of_rotation, rotation_gap
from tests.tuning_latency_model import LatencyModel

ROUTINGS = ("round-robin", "least-load")
FLEET_P99S = ("merged", "worst-pod")


@dataclass
class Pod:
    model: LatencyModel
    ready_at: float
    name: str = ""  # stable for the pod's life: the key of the rotation's set


def even(backlogs: list[float], capacity: float, rate: float, dt: float) -> list[float]:
    """Round-robin: the same share for every pod, whatever its queue."""
    return [rate / len(backlogs)] * len(backlogs)


def in_rotation(out: list[bool], rate: float) -> list[float]:
    """Round-robin over the pods in rotation (`out`: each pod out of it or not): the same share for each
    pod in, none for a pod out."""
    k = len(out) - sum(out)
    return [0.0 if o else rate / k for o in out]


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


def merged_p99(p99s: list[float], weights: list[float], q: float = 0.99) -> float:
    """The q-quantile of the pods' latencies pooled (each pod weighing by the requests it finished), with
    each pod's tail above its own p99 taken as exponential (the latency model's TTFT is a few times an
    exponential-ish wait): P(X > x) = (1 - q)^(x / p99). Between the smallest and the largest p99; the
    common p99 when all are equal; near a worse pod's when it finishes a good share of the requests."""
    pods = [(p, w) for p, w in zip(p99s, weights, strict=True) if w > 0 and p > 0]
    if not pods:
        return max(p99s)
    total, k = sum(w for _, w in pods), -math.log(1 - q)
    lo, hi = min(p for p, _ in pods), max(p for p, _ in pods)
    for _ in range(50):  # bisection: the pooled tail falls as x grows
        mid = (lo + hi) / 2
        tail = sum(w * math.exp(-k * mid / p) for p, w in pods) / total
        lo, hi = (mid, hi) if tail > 1 - q else (lo, mid)
    return hi


def merge_windows(subs: list[Observation]) -> Observation:
    """Back-to-back windows as one, as the operator's sliding window reads them: rates and gauges averaged
    over the time, samples summed, p99s the pooled quantile (each window weighing by its samples)."""
    if len(subs) == 1:
        return subs[0]
    dts = [o.end - o.start for o in subs]
    span = sum(dts)

    def mean(values: list[float]) -> float:
        return sum(v * dt for v, dt in zip(values, dts, strict=True)) / span

    def p99(values: list[float | None]) -> float | None:
        pairs = [(v, float(o.num_samples)) for v, o in zip(values, subs, strict=True) if v is not None]
        return merged_p99([v for v, _ in pairs], [w for _, w in pairs]) if pairs else None

    last = subs[-1]
    queue_times = [(o.queue_time_mean_s, o.request_rate * dt) for o, dt in zip(subs, dts, strict=True)
                   if o.queue_time_mean_s is not None]
    finished = sum(w for _, w in queue_times)
    return Observation(
        start=subs[0].start, end=last.end, num_pods=last.num_pods, num_samples=sum(o.num_samples for o in subs),
        ttft_p99_s=p99([o.ttft_p99_s for o in subs]), itl_p99_s=p99([o.itl_p99_s for o in subs]),
        request_rate=mean([o.request_rate for o in subs]), prompt_token_rate=mean([o.prompt_token_rate for o in subs]),
        generation_token_rate=mean([o.generation_token_rate for o in subs]),
        waiting=mean([o.waiting for o in subs]), running=mean([o.running for o in subs]),
        queue_time_mean_s=sum(q * w for q, w in queue_times) / finished if finished else last.queue_time_mean_s,
        kv_usage=max(o.kv_usage for o in subs), preemption_rate=mean([o.preemption_rate for o in subs]),
        error_rate=0.0)


class FleetSim:
    """Pods of the latency model (`model`: its parameters) behind `routing` (one of ROUTINGS); with
    `shared_cores` ({pods: speed}), each ready pod runs at the speed the number of ready pods allows.
    `rotation` (round-robin only; least-load never rotates): the operator's rotation of backlogged pods
    out of the Service; `out` holds the names of the pods out of it in the last window."""

    def __init__(self, replicas: int, seed: int, start_s: float, routing: str = "round-robin",
                 fleet_p99: str = "merged", model: dict | None = None, shared_cores: dict[int, float] | None = None,
                 rotation: bool = True):
        self.seed, self.start_s, self.made, self.route = seed, start_s, 0, ROUTE[routing]
        self.rotation = rotation and routing == "round-robin"
        self.out: frozenset[str] = frozenset()
        self.per_pod_rate = 0.0  # requests/s each ready pod finished over the last window
        self.worst = {"merged": False, "worst-pod": True}[fleet_p99]
        self.model, self.shared_cores = model or {}, shared_cores or {}
        self.pods = [self._pod(-1.0) for _ in range(replicas)]

    def _pod(self, ready_at: float) -> Pod:
        self.made += 1
        return Pod(LatencyModel(**self.model, seed=self.seed * 1000 + self.made), ready_at, f"pod-{self.made}")

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
        summed, p99s the summed histograms' (or the worst pod's)."""
        ready = [p for p in self.pods if p.ready_at <= start]
        for p in ready:
            p.model.slowdown = 1.0 / self.shared_cores.get(len(ready), 1.0)
        capacity = ready[0].model.steady(knobs, rate / len(ready)).capacity  # one model, one setting: equal
        before = [p.model.backlog for p in ready]
        if self.rotation:  # the operator's tick: the pods' queues read, the Service's endpoints relabelled
            gap = rotation_gap(self.per_pod_rate, end - start)
            self.out = out_of_rotation({p.name: b for p, b in zip(ready, before, strict=True)}, gap)
            rates = in_rotation([p.name in self.out for p in ready], rate)
        else:
            rates = self.route(before, capacity, rate, end - start)
        obs = [p.model.window(knobs, r, start, end) for p, r in zip(ready, rates, strict=True)]
        # what each pod finished: its arrivals and what its backlog went down by (a draining pod that gets
        # no new request still serves its queue, at its full TTFT)
        done = [r * (end - start) + b - p.model.backlog for p, r, b in zip(ready, rates, before, strict=True)]
        self.per_pod_rate = sum(done) / (end - start) / len(ready)

        def pool(p99s: list[float]) -> float:
            return max(p99s) if self.worst else merged_p99(p99s, done)

        return Observation(
            start=start, end=end, num_pods=len(obs), num_samples=sum(o.num_samples for o in obs),
            ttft_p99_s=pool([o.ttft_p99_s for o in obs]), itl_p99_s=pool([o.itl_p99_s for o in obs]),
            request_rate=sum(o.request_rate for o in obs), prompt_token_rate=sum(o.prompt_token_rate for o in obs),
            generation_token_rate=sum(o.generation_token_rate for o in obs), waiting=sum(o.waiting for o in obs),
            running=sum(o.running for o in obs), queue_time_mean_s=max(o.queue_time_mean_s for o in obs),
            kv_usage=max(o.kv_usage for o in obs), preemption_rate=sum(o.preemption_rate for o in obs),
            error_rate=0.0)

    def ready(self, now: float) -> int:
        return sum(p.ready_at <= now for p in self.pods)
