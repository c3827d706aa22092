"""Replicas against the SLO, in the trace-driven fleet simulator: knobs only, knobs + replicas (the
operator's `decide` and `decide_scale`), and an HPA-style controller on queue depth at each threshold of
a grid, side by side in one run.

    python benchmarks/autoscaling.py [--fleets 2,4,8,16,32] [--seeds 3] [--thresholds 0.5,1,2,4,8,16]
                                     [--routings round-robin,least-load] [--max-replicas 2] [--min-replicas 1]
                                     [--scenario tuning-tests|live-fit|live-fit-shared|live-fit-dips]
                                     [--no-rotation]
                                     [--out benchmarks/results/autoscaling.json]   # a few minutes here

What runs is a scenario (benchmarks/fleet_scenario.py): the table of record's, described below, or the
same model fitted to the live pods of benchmarks/autoscaling_live.py at their cadence (a tick every 5 s on
a 20-s window, the SLO judged on back-to-back 20-s windows), load and pod starts, or those pods under a
longer peak broken by two 30-s dips.

The fleet (benchmarks/fleet_sim.py): pods of the latency model the tuning tests use
(tests/tuning_latency_model.py: M/M/c-like queueing, a backlog above capacity, ITL growing with the batch
and the chunk, 8% multiplicative noise) behind the routing each configuration has: `round-robin` (a plain
Service with the operator's rotation: every ready pod the same share but those whose queue stands over
the shortest by more than a tick's work, which get none that tick; `--no-rotation`: a plain Service
alone, every ready pod the same share) or `least-load` (spec.router: a pod with a longer queue gets no
new requests until it has drained to its peers' level; no rotation); every controller is compared behind
the same routing. A new pod is ready `--start-s` after it is asked for, a removed pod's queue goes to the others
(it drains: nothing is lost). Every tick (30 s, a 30-s window, in the table of record's) the fleet's
window is every pod's merged as the operator merges the pods' /metrics: rates and queues summed, p99s the
quantile of the summed histograms (`--fleet-p99 worst-pod`: the worst pod's p99, which grows with the
fleet by noise alone).

The load, per fleet size F: one pod carries at most `CAPACITY` requests/s within the SLO at its best
knobs, so the peak needs F pods at any setting; a stepped Poisson-like rate of 0.25F, F, 0.5F, 0.25F
pods' worth (20, 40, 40, 30 ticks), starting from knobs far from tuned (max_num_seqs 4).
- knobs only: the tuner in auto mode on a fixed fleet sized for the first phase (what the product did
  before spec.autoscaling: BoundsReached at the peak);
- knobs + replicas: the tuner and the autoscaler, minReplicas 1 (`--min-replicas N`, the HPA's too),
  maxReplicas 2F (`--max-replicas K`: KF, the HPA's too), default windows;
- HPA: desired = ceil(pods x mean waiting per pod / threshold) with the HPA's 10% tolerance, its default
  scale-up limit, and the shipped example's scale-down (300 s stabilization, one pod a minute), on the
  tuner's knobs (the tuner in auto mode beside it, as a user of both would run them); best threshold:
  the cheapest that reaches 99% of windows within the SLO after convergence, else the one with the most
  windows within it.
Every controller runs the tuner in auto mode, and rotation is part of the operator in auto mode, so all
three rotate behind round-robin. An HPA user without the operator has no rotation, so behind round-robin
the HPA's grid is the thresholds with rotation and without, and its best is chosen over both (the row
says which: "no rot" for the plain Service alone).
Reported per fleet size and routing (medians over seeds): windows within the SLO (all; after convergence,
leaving out the windows that overlap the settling after each step of the load: 10 ticks in the table of
record's) and replica-seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_scenario import SCENARIOS, TUNING_TESTS, Scenario  # noqa: E402
from benchmarks.fleet_sim import FLEET_P99S, ROUTINGS, FleetSim, merge_windows  # noqa: E402
from iterserve.operator.tuning.decide import HOLD, Decision, TunerState, decide  # noqa: E402
from iterserve.operator.tuning.decision import stay  # noqa: E402
from iterserve.operator.tuning.fleet_change import OutsideScale, scale_out_in_flight, second_look  # noqa: E402
from iterserve.operator.tuning.observation import Observation  # noqa: E402
from iterserve.operator.tuning.reading import read  # noqa: E402
from iterserve.operator.tuning.scale import SCALE_OUT, Fleet, ScaleDecision, ScalePolicy, ScaleState, decide_scale  # noqa: E402

# the table of record's scenario (benchmarks/fleet_scenario.py's TUNING_TESTS), by its old names
TICK_S = TUNING_TESTS.tick_s
POLICY = TUNING_TESTS.policy
START = TUNING_TESTS.start
CAPACITY = 20.0  # requests/s one pod finishes within the SLO at its best knobs (TUNING_TESTS.slo_capacity())
HPA_TOLERANCE, HPA_DOWN_WINDOW_S, HPA_DOWN_EVERY_S = 0.1, 300.0, 60.0


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


def load(fleet: int, scenario: Scenario = TUNING_TESTS) -> list[tuple[float, bool]]:
    """(requests/s, past the settling ticks) per tick."""
    out = []
    for per_f, seconds in scenario.phases:
        out += [(per_f * fleet, i >= scenario.ticks(scenario.settle_s)) for i in range(scenario.ticks(seconds))]
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
    down_window_s: float = HPA_DOWN_WINDOW_S
    down_every_s: float = HPA_DOWN_EVERY_S
    history: list[tuple[float, int]] = field(default_factory=list)
    last_down: float = -math.inf

    def desired(self, current: int, obs: Observation, now: float) -> int:
        ratio = obs.queued / max(obs.num_pods, 1) / self.threshold
        want = current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(obs.num_pods * ratio)
        want = min(max(want, self.lo), self.hi, max(2 * current, current + 4))
        self.history.append((now, want))
        self.history[:] = [(t, w) for t, w in self.history if now - t <= self.down_window_s]
        if want >= current:
            return want
        want = max(w for _, w in self.history)
        if want >= current or now - self.last_down < self.down_every_s:
            return current
        self.last_down = now
        return current - 1


ScaleFn = Callable[[ScaleState, Fleet, ScalePolicy, float], ScaleDecision]
# why the tuner's move should be held this tick, from the scaler's state and the replicas asked for and ready
HoldFn = Callable[[ScaleState, int, int, ScalePolicy, float, float], "str | None"]


class Probe(Protocol):
    """Looks into a run tick by tick (benchmarks/autoscaling_whatif.py: traces and counterfactuals)."""

    def before(self, tick: int, sim: FleetSim, t: float) -> None: ...  # the window is about to run

    def after(self, tick: int, sim: FleetSim, obs: Observation, met: bool, tuner: Decision,
              scaled: ScaleDecision | None) -> None: ...  # it ran; the controllers decided (not yet applied)


def simulate(fleet: int, seed: int, controller: str, threshold: float = 0.0, start_s: float | None = None,
             routing: str = "round-robin", fleet_p99: str = "merged", max_replicas: int | None = None,
             probe: Probe | None = None, min_replicas: int = 1, scaler: ScaleFn = decide_scale,
             tuner_hold: HoldFn | None = None, scenario: Scenario = TUNING_TESTS, rotation: bool = True) -> Run:
    """One run; `min_replicas` and `max_replicas` (default 1 and 2F) bound the autoscaler and the HPA alike;
    `start_s` (default the scenario's) is how long a new pod takes to be ready; `scaler` is the autoscaler's
    decision (the product's, or a variant benchmarks/autoscaling_whatif.py tries); `tuner_hold`, a variant the
    product does not have: the tuner's moves are held back (preemptions excepted) on the ticks it gives a
    reason for. Where the scenario's window is several ticks long, the controllers read the ticks of the last
    window (since the last knob change, as the operator's window never reaches back past one), and the SLO is
    judged on back-to-back windows. `rotation`: the operator's rotation behind round-robin (False: a plain
    Service alone; least-load never rotates)."""
    sc, policy = scenario, scenario.policy
    tick_s, per_window = sc.tick_s, sc.window_ticks
    rates = load(fleet, sc)
    # spec.replicas: what the first phase needs at 0.9 of a pod's capacity within the SLO, clamped into the range
    per_pod = CAPACITY if sc is TUNING_TESTS else sc.slo_capacity()
    first = max(min_replicas, math.ceil(rates[0][0] / (per_pod * 0.9)))
    sim = FleetSim(first, seed, sc.start_s if start_s is None else start_s, routing, fleet_p99, sc.model,
                   sc.shared_cores, rotation)
    run, tuner, scaler_state = Run(), TunerState(sc.start), ScaleState()
    hi = 2 * fleet if max_replicas is None else max_replicas
    scale_policy = ScalePolicy(min_replicas=min_replicas, max_replicas=hi, scale_down_window_s=sc.scale_down_s,
                               settle_s=policy.window_s, window_s=policy.window_s, headroom_line=policy.headroom_line)
    hpa = Hpa(threshold, min_replicas, hi, down_window_s=sc.scale_down_s)
    hpa_every = 1 if sc.hpa_period_s is None else max(1, round(sc.hpa_period_s / tick_s))
    t = 0.0
    outside, listed = OutsideScale(), 0  # the HPA's fleet as the operator follows it, and the pods it last listed
    seen: list[Observation] = []  # the controllers' window: the ticks since the last knob change, at most a window
    judged: list[Observation] = []  # the SLO's window: back-to-back blocks of `per_window` ticks
    for tick, (rate, _) in enumerate(rates):
        if probe is not None:
            probe.before(tick, sim, t)
        replicas = len(sim.pods)
        sub = sim.window(tuner.knobs, rate, t, t + tick_s)
        t += tick_s
        seen = (seen + [sub])[-per_window:]
        judged.append(sub)
        run.replica_s += replicas * tick_s
        run.replicas.append(replicas)
        obs = merge_windows(seen)
        r = read(obs, policy)
        if len(judged) == per_window:
            block = merge_windows(judged)
            verdict = read(block, policy)
            run.within.append(verdict.met and verdict.trouble is None)
            # after convergence: no tick of the window within the settling after a step
            run.settled.append(all(settled for _, settled in rates[tick + 1 - per_window:tick + 1]))
            judged = []
        # the tuner is told of a scale-out in flight, the autoscaler's or the HPA's, as in the operator
        if controller == "replicas":
            in_flight = scale_out_in_flight(scaler_state, replicas, sim.ready(t), scale_policy, t)
        else:
            outside = outside.see(replicas, listed, t)
            in_flight = outside.in_flight(listed, policy.window_s, t)
            outside, listed = outside.queue(obs.queued, t), sim.ready(t)
        knobs_before = tuner.knobs
        d = decide(tuner, obs, policy, t, in_flight)

        def view(d: Decision) -> Fleet:
            return Fleet(replicas=replicas, ready=sim.ready(t), obs=obs,
                         reading=r if obs.num_samples >= policy.min_samples else None, verdict=d.tuned,
                         tuner_action=d.action, batch_cap=d.state.knobs.max_num_seqs, knobs=d.state.knobs)

        if controller == "replicas":  # the tuner's move again, when the scaler grows the fleet on this window
            d = second_look(d, in_flight, obs.queued, lambda so: decide(tuner, obs, policy, t, so),
                            lambda x: scaler(scaler_state, view(x), scale_policy, t).action == SCALE_OUT)
        if tuner_hold is not None and controller == "replicas" and d.action != HOLD and r.trouble is None and \
                (why := tuner_hold(scaler_state, replicas, sim.ready(t), scale_policy, t, obs.queued)) is not None:
            d = stay(tuner, t, why, None, tuner.tuned)
        tuner = d.state
        if tuner.knobs != knobs_before:
            seen = []
        s = None
        if controller == "replicas":
            s = scaler(scaler_state, view(d), scale_policy, t)
            scaler_state = s.state
        if probe is not None:
            probe.after(tick, sim, obs, r.met and r.trouble is None, d, s)
        if s is not None:
            sim.resize(s.replicas, t)
        elif controller == "hpa" and (tick + 1) % hpa_every == 0:
            sim.resize(hpa.desired(replicas, obs, t), t)
    return run


def median_summary(runs: list[Run]) -> dict:
    sums = [r.summary() for r in runs]
    return {k: statistics.median(s[k] for s in sums) for k in sums[0]}


def best_hpa(grid: dict[tuple[float, bool], dict]) -> tuple[tuple[float, bool], dict]:
    """The best of the HPA's `grid` ({(threshold, rotation): summary}): the cheapest that reaches 99% of
    windows within the SLO after convergence, else the one with the most windows within it; (key, summary)."""
    passing = {k: s for k, s in grid.items() if s["within_slo_settled"] >= 0.99}
    if passing:
        return min(passing.items(), key=lambda kv: kv[1]["replica_s"])
    return max(grid.items(), key=lambda kv: kv[1]["within_slo_settled"])


def compare(fleet: int, routing: str, seeds: range, thresholds: list[float], start_s: float | None,
            fleet_p99: str = "merged", max_factor: int = 2, lo: int = 1, scenario: Scenario = TUNING_TESTS,
            rotation: bool = True) -> dict:
    """One fleet size behind one routing: the three controllers, the HPA at each threshold (behind
    round-robin with rotation, at each threshold with rotation and without: `hpa` and `hpa_no_rotation`).
    `rotation` is whether the operator rotates pods behind round-robin (the row's `rotation`)."""
    rotation = rotation and routing == "round-robin"
    row: dict = {"fleet": fleet, "routing": routing, "rotation": rotation}
    hi = max_factor * fleet
    for name in ("knobs", "replicas"):
        row[name] = median_summary([simulate(fleet, s, name, 0.0, start_s, routing, fleet_p99, hi, min_replicas=lo,
                                             scenario=scenario, rotation=rotation) for s in seeds])

    def grid(rot: bool) -> dict:
        return {str(th): median_summary([simulate(fleet, s, "hpa", th, start_s, routing, fleet_p99, hi,
                                                  min_replicas=lo, scenario=scenario, rotation=rot) for s in seeds])
                for th in thresholds}

    row["hpa"] = grid(rotation)
    configs = {(float(k), rotation): v for k, v in row["hpa"].items()}
    if rotation:  # an HPA user without the operator: a plain Service alone
        row["hpa_no_rotation"] = grid(False)
        configs |= {(float(k), False): v for k, v in row["hpa_no_rotation"].items()}
    (th, rot), best = best_hpa(configs)
    row["best_hpa_threshold"], row["best_hpa_rotation"] = th, rot
    ours = row["replicas"]
    row["replica_s_ratio_to_best_hpa"] = ours["replica_s"] / best["replica_s"]
    row["pass"] = ours["within_slo_settled"] >= 0.99 and ours["replica_s"] <= best["replica_s"]
    return row


def hpa_label(row: dict) -> str:
    """The best HPA's configuration: its threshold, and behind round-robin whether it rotates."""
    th, rot = row["best_hpa_threshold"], row["best_hpa_rotation"]
    return f"HPA queue, best {th:g}" + ("" if row["routing"] != "round-robin" else ", rot" if rot else ", no rot")


def print_row(row: dict) -> None:
    th, rot = row["best_hpa_threshold"], row["best_hpa_rotation"]
    best = row["hpa" if rot == row["rotation"] else "hpa_no_rotation"][str(th)]
    hpa = hpa_label(row)
    for label, s in (("knobs only", row["knobs"]), ("knobs + replicas", row["replicas"]), (hpa, best)):
        ratio = f"{s['replica_s'] / best['replica_s']:.2f}x" if label != hpa else ""
        print(f"{row['fleet']:>5} | {row['routing']:<11} | {label:<27} | {s['within_slo']:>7.1%} | "
              f"{s['within_slo_settled']:>7.1%} | {s['replica_s']:>9.0f} | {s['peak_replicas']:>4.0f} | {ratio}")
    print(f"{'':>5} | {'':<11} | {'target':<27} | {'':>7} | {'>=99%':>7} | {'<= best':>9} | {'':>4} | "
          f"{'PASS' if row['pass'] else 'MISS'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", default="2,4,8,16,32")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--thresholds", default="0.5,1,2,4,8,16")
    ap.add_argument("--routings", default=",".join(ROUTINGS),
                    help="round-robin (a plain Service), least-load (spec.router), or both")
    ap.add_argument("--fleet-p99", choices=FLEET_P99S, default="merged",
                    help="the fleet's p99: the pods' histograms summed (what the operator reads), or the worst pod's")
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="tuning-tests",
                    help="the pods' model, SLO, cadence and load (benchmarks/fleet_scenario.py): the tuning tests' "
                         "model, or it fitted to the live pods (and sharing the live machine's cores)")
    ap.add_argument("--start-s", type=float, default=None,
                    help="seconds a new pod takes to be ready (default: the scenario's, 60 or 12)")
    ap.add_argument("--max-replicas", type=int, default=2, metavar="K",
                    help="maxReplicas as K times the fleet size F, for the autoscaler and the HPA alike")
    ap.add_argument("--min-replicas", type=int, default=1, metavar="N",
                    help="minReplicas for the autoscaler and the HPA alike (and the fleet's least at the start)")
    ap.add_argument("--no-rotation", action="store_true",
                    help="round-robin without the operator's rotation (a plain Service alone), for every controller")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    fleets = [int(x) for x in args.fleets.split(",")]
    thresholds = [float(x) for x in args.thresholds.split(",")]
    routings = args.routings.split(",")
    if unknown := set(routings) - set(ROUTINGS):
        ap.error(f"--routings: {', '.join(sorted(unknown))} is not one of {', '.join(ROUTINGS)}")
    scenario = SCENARIOS[args.scenario]()
    results = []
    if scenario is not TUNING_TESTS:
        m = scenario.model
        print(f"scenario {scenario.name}: t0 {m['t0'] * 1e3:.2f} ms, {m['per_seq'] * 1e3:.2f} ms a sequence, "
              f"{m['per_prefill_token'] * 1e3:.3f} ms a prompt token; SLO {scenario.policy.ttft_p99_ms:g} / "
              f"{scenario.policy.itl_p99_ms:g} ms; a pod carries {scenario.slo_capacity():.2f} requests/s within it")
    print(f"{'fleet':>5} | {'routing':<11} | {'controller':<27} | {'in SLO':>7} | {'settled':>7} | "
          f"{'replica-s':>9} | {'peak':>4} | vs best HPA")
    for fleet in fleets:
        for routing in routings:
            results.append(compare(fleet, routing, range(args.seeds), thresholds, args.start_s, args.fleet_p99,
                                   args.max_replicas, args.min_replicas, scenario, not args.no_rotation))
            print_row(results[-1])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
