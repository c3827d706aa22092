"""Replicas against the SLO, in the trace-driven fleet simulator: knobs only, knobs + replicas (the
operator's `decide` and `decide_scale`), and an HPA-style controller on queue depth at each threshold of
a grid, side by side in one run.

    python benchmarks/autoscaling.py [--fleets 2,4,8,16,32] [--seeds 3] [--thresholds 0.5,1,2,4,8,16]
                                     [--out benchmarks/results/autoscaling.json]   # about a minute here

The fleet: pods of the latency model the tuning tests use (tests/tuning_latency_model.py: M/M/c-like
queueing, a backlog above capacity, ITL growing with the batch and the chunk, 8% multiplicative noise),
the load spread evenly over the ready pods, a new pod ready `--start-s` after it is asked for, a removed
pod's queue going to the others (it drains: nothing is lost). Every tick (30 s, a 30 s window) the
fleet's window is every pod's merged (p99s: the worst pod's; rates and queues: summed), which is what
the operator reads from the pods' /metrics.

The load, per fleet size F: one pod carries at most `CAPACITY` requests/s within the SLO at its best
knobs, so the peak needs F pods at any setting; a stepped Poisson-like rate of 0.25F, F, 0.5F, 0.25F
pods' worth (20, 40, 40, 30 ticks), starting from knobs far from tuned (max_num_seqs 4).
- knobs only: the tuner in auto mode on a fixed fleet sized for the first phase (what the product did
  before spec.autoscaling: BoundsReached at the peak);
- knobs + replicas: the tuner and the autoscaler, minReplicas 1, maxReplicas 2F, default windows;
- HPA: desired = ceil(pods x mean waiting per pod / threshold) with the HPA's 10% tolerance, its default
  scale-up limit, and the shipped example's scale-down (300 s stabilization, one pod a minute), on the
  tuner's knobs (the tuner in auto mode beside it, as a user of both would run them); best threshold: the cheapest that
  reaches 99% of
  windows within the SLO after convergence, else the one with the most windows within it.
Reported per fleet size (medians over seeds): windows within the SLO (all; after convergence, leaving
out `SETTLE_TICKS` ticks after each step of the load) and replica-seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from iterserve.operator.tuning.decide import TunerState, decide  # noqa: E402
from iterserve.operator.tuning.knobs import Knobs  # noqa: E402
from iterserve.operator.tuning.observation import Observation  # noqa: E402
from iterserve.operator.tuning.policy import TuningPolicy  # noqa: E402
from iterserve.operator.tuning.reading import read  # noqa: E402
from iterserve.operator.tuning.scale import Fleet, ScalePolicy, ScaleState, decide_scale  # noqa: E402
from tests.tuning_latency_model import LatencyModel  # noqa: E402

TICK_S = 30.0
POLICY = TuningPolicy(ttft_p99_ms=1500, itl_p99_ms=40, max_num_seqs_bounds=(1, 64),
                      prefill_chunk_size_bounds=(16, 512), interval_s=TICK_S, window_s=TICK_S, seqs_step=4,
                      min_samples=20)
START = Knobs(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=256)
CAPACITY = 20.0  # requests/s one pod finishes within the SLO at its best knobs (LatencyModel().meets)
PHASES = ((0.25, 20), (1.0, 40), (0.5, 40), (0.25, 30))  # (share of the peak, ticks)
SETTLE_TICKS = 10  # after each step of the load: what "after convergence" leaves out
HPA_TOLERANCE, HPA_DOWN_WINDOW_S, HPA_DOWN_EVERY_S = 0.1, 300.0, 60.0


@dataclass
class Pod:
    model: LatencyModel
    ready_at: float


@dataclass
class Run:
    within: list[bool] = field(default_factory=list)
    settled: list[bool] = field(default_factory=list)  # the window is past the settling ticks
    replica_s: float = 0.0
    replicas: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        after = [w for w, s in zip(self.within, self.settled, strict=True) if s]
        return {"within_slo": sum(self.within) / len(self.within), "within_slo_settled": sum(after) / len(after),
                "replica_s": self.replica_s, "peak_replicas": max(self.replicas)}


class FleetSim:
    """Pods of the latency model behind an even load balancer."""

    def __init__(self, replicas: int, seed: int, start_s: float):
        self.seed, self.start_s, self.made = seed, start_s, 0
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
        ready = [p for p in self.pods if p.ready_at <= start]
        obs = [p.model.window(knobs, rate / len(ready), start, end) for p in ready]
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


def load(fleet: int) -> list[tuple[float, bool]]:
    """(requests/s, past the settling ticks) per tick."""
    out = []
    for share, ticks in PHASES:
        out += [(share * fleet * CAPACITY * 0.9, i >= SETTLE_TICKS) for i in range(ticks)]
    return out


@dataclass
class Hpa:
    """Kubernetes' HPA on an AverageValue pods metric, with the behavior of the shipped example
    (manifests/samples/external-autoscalers/hpa-prometheus-adapter.yaml): the ratio to the target, a 10%
    tolerance, scale-up at most max(double, +4) a period, scale-down to the highest recommendation of the
    300 s stabilization window and at most one pod a minute."""

    threshold: float
    lo: int
    hi: int
    history: list[tuple[float, int]] = field(default_factory=list)
    last_down: float = -math.inf

    def desired(self, current: int, obs: Observation, now: float) -> int:
        ratio = obs.queued / max(obs.num_pods, 1) / self.threshold
        want = current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(obs.num_pods * ratio)
        want = min(max(want, self.lo), self.hi, max(2 * current, current + 4))
        self.history.append((now, want))
        self.history[:] = [(t, w) for t, w in self.history if now - t <= HPA_DOWN_WINDOW_S]
        if want >= current:
            return want
        want = max(w for _, w in self.history)
        if want >= current or now - self.last_down < HPA_DOWN_EVERY_S:
            return current
        self.last_down = now
        return current - 1


def simulate(fleet: int, seed: int, controller: str, threshold: float = 0.0, start_s: float = 60.0) -> Run:
    rates = load(fleet)
    first = max(1, math.ceil(rates[0][0] / (CAPACITY * 0.9)))
    sim, run = FleetSim(first, seed, start_s), Run()
    tuner = TunerState(START)
    scaler = ScaleState()
    scale_policy = ScalePolicy(min_replicas=1, max_replicas=2 * fleet, settle_s=TICK_S,
                               headroom_line=POLICY.headroom_line)
    hpa = Hpa(threshold, 1, 2 * fleet)
    t = 0.0
    for rate, settled in rates:
        replicas = len(sim.pods)
        obs = sim.window(tuner.knobs, rate, t, t + TICK_S)
        t += TICK_S
        r = read(obs, POLICY)
        run.within.append(r.met and r.trouble is None)
        run.settled.append(settled)
        run.replica_s += replicas * TICK_S
        run.replicas.append(replicas)
        d = decide(tuner, obs, POLICY, t)
        tuner = d.state
        if controller == "replicas":
            view = Fleet(replicas=replicas, ready=sim.ready(t), obs=obs,
                         reading=r if obs.num_samples >= POLICY.min_samples else None, verdict=d.tuned,
                         tuner_action=d.action, batch_cap=tuner.knobs.max_num_seqs, knobs=tuner.knobs)
            s = decide_scale(scaler, view, scale_policy, t)
            scaler = s.state
            sim.resize(s.replicas, t)
        elif controller == "hpa":
            sim.resize(hpa.desired(replicas, obs, t), t)
    return run


def median_summary(runs: list[Run]) -> dict:
    sums = [r.summary() for r in runs]
    return {k: statistics.median(s[k] for s in sums) for k in sums[0]}


def best_hpa(by_threshold: dict[float, dict]) -> tuple[float, dict]:
    passing = {t: s for t, s in by_threshold.items() if s["within_slo_settled"] >= 0.99}
    if passing:
        return min(passing.items(), key=lambda kv: kv[1]["replica_s"])
    return max(by_threshold.items(), key=lambda kv: kv[1]["within_slo_settled"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", default="2,4,8,16,32")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--thresholds", default="0.5,1,2,4,8,16")
    ap.add_argument("--start-s", type=float, default=60.0, help="seconds a new pod takes to be ready")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    fleets = [int(x) for x in args.fleets.split(",")]
    thresholds = [float(x) for x in args.thresholds.split(",")]
    seeds = range(args.seeds)
    results = []
    print(f"{'fleet':>5} | {'controller':<22} | {'in SLO':>7} | {'settled':>7} | {'replica-s':>9} | "
          f"{'peak':>4} | vs best HPA")
    for fleet in fleets:
        row = {"fleet": fleet}
        for name in ("knobs", "replicas"):
            row[name] = median_summary([simulate(fleet, s, name, start_s=args.start_s) for s in seeds])
        row["hpa"] = {str(th): median_summary([simulate(fleet, s, "hpa", th, args.start_s) for s in seeds])
                      for th in thresholds}
        th, best = best_hpa({float(k): v for k, v in row["hpa"].items()})
        row["best_hpa_threshold"] = th
        ours = row["replicas"]
        row["replica_s_ratio_to_best_hpa"] = ours["replica_s"] / best["replica_s"]
        row["pass"] = ours["within_slo_settled"] >= 0.99 and ours["replica_s"] <= best["replica_s"]
        for label, s in (("knobs only", row["knobs"]), ("knobs + replicas", ours),
                         (f"HPA queue, best {th:g}", best)):
            ratio = f"{s['replica_s'] / best['replica_s']:.2f}x" if label != f"HPA queue, best {th:g}" else ""
            print(f"{fleet:>5} | {label:<22} | {s['within_slo']:>7.1%} | {s['within_slo_settled']:>7.1%} | "
                  f"{s['replica_s']:>9.0f} | {s['peak_replicas']:>4.0f} | {ratio}")
        print(f"{'':>5} | {'target':<22} | {'':>7} | {'>=99%':>7} | {'<= best':>9} | {'':>4} | "
              f"{'PASS' if row['pass'] else 'MISS'}")
        results.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
