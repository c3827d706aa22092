"""What would have met the SLO where knobs + replicas misses in benchmarks/autoscaling.py: the same runs
with one thing changed at a time, side by side, and a tick-by-tick trace of any of them.

    python benchmarks/autoscaling_whatif.py [--fleet 2] [--routing round-robin] [--seeds 5] [--no-rotation]   # seconds
    python benchmarks/autoscaling_whatif.py --trace 0 [--case "as is"] [--ticks 18-40]

Cases (knobs + replicas unless named; medians over seeds; `--no-rotation`: every case behind round-robin
without the operator's rotation):
- `as is`: the benchmark's run (maxReplicas 2F, pods ready 60 s after they are asked for; behind
  round-robin, the operator's rotation of backlogged pods out of the Service);
- `foresight`: maxReplicas asked for at the first instant of the peak, before any window shows it (no
  controller that reads windows can: the first one showing the peak ends a window into it);
- `pre-provisioned`: maxReplicas ready when the peak begins (asked a pod start before it), which only a
  fleet already scaled out for another reason has;
- `pods ready in half the time`, `maxReplicas 2F+1`, `3F`, `4F`, `minReplicas 2`: the cluster or the
  user's range;
- `pod more on waiting queue`: the autoscaler with a rule tried and not adopted (`out_on_waiting`);
- `tuner holds while scaling`: the tuner moves no knob (preemptions excepted) while pods a scale-out
  added are starting and for a window after the fleet last changed (`tuner_holds_while_scaling`), tried
  and not adopted (the product holds back a back-off of max_num_seqs only: operator/tuning/fleet_change.py);
- `headroom on latency alone`: the autoscaler's headroom judged on TTFT (the queue's drain included) and
  not on how many requests wait (`LatencyHeadroom`), tried and not adopted;
- `no rotation` (behind round-robin): a plain Service alone, without the operator's rotation
  (operator/tuning/rotation.py): what the benchmark ran before it;
- `least-load`: behind spec.router instead of the routing given.
The trace prints, per tick: the load and the completions (requests/s), the replicas asked for and
ready, each pod's backlog at the window's end (requests queued beyond its steady state: where a plain
Service leaves a step's excess; a trailing `o`: the pod was out of rotation during the window), the
fleet's waiting queue and p99 TTFT as the operator pools them, whether the window met the SLO (`*`:
within the settling ticks), the knobs, the tuner's verdict and the autoscaler's reason.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.autoscaling import Run, load, simulate  # noqa: E402
from benchmarks.fleet_scenario import SCENARIOS, TUNING_TESTS, Scenario  # noqa: E402
from benchmarks.fleet_sim import ROUTINGS, FleetSim  # noqa: E402
from iterserve.operator.tuning.actions import HOLD  # noqa: E402
from iterserve.operator.tuning.decision import Decision  # noqa: E402
from iterserve.operator.tuning.fleet_change import scale_out_in_flight, told  # noqa: E402
from iterserve.operator.tuning.observation import Observation  # noqa: E402
from iterserve.operator.tuning.scale import (  # noqa: E402
    SCALE_IN,
    SCALE_OUT,
    SCALE_RULES,
    Fleet,
    ScaleDecision,
    ScalePolicy,
    ScaleState,
    decide_scale,
)
from iterserve.operator.tuning.scale_tick import Tick  # noqa: E402


def peak_tick(scenario: Scenario) -> int:
    """The first tick of the peak."""
    return scenario.ticks(scenario.phases[0][1])



@dataclass
class Asks:
    """Resizes the fleet to `replicas` before the window of `tick` runs: an ask no window has shown."""

    tick: int
    replicas: int

    def before(self, tick: int, sim: FleetSim, t: float) -> None:
        if tick == self.tick:
            sim.resize(self.replicas, t)

    def after(self, tick: int, sim: FleetSim, obs: Observation, met: bool, tuner: Decision,
              scaled: ScaleDecision | None) -> None:
        pass


@dataclass
class Trace:
    """Prints the ticks in [lo, hi] of a run on `plan` (benchmarks/autoscaling.load's)."""

    lo: int
    hi: int
    plan: list[tuple[float, bool]]
    inner: Asks | None = None
    tick_s: float = 30.0  # the pods listed are those ready for the tick's own window (not the merged window's)

    def before(self, tick: int, sim: FleetSim, t: float) -> None:
        if self.inner is not None:
            self.inner.before(tick, sim, t)

    def after(self, tick: int, sim: FleetSim, obs: Observation, met: bool, tuner: Decision,
              scaled: ScaleDecision | None) -> None:
        if not self.lo <= tick <= self.hi:
            return
        k = tuner.state.knobs
        backlog = ",".join(f"{p.model.backlog:.0f}{'o' if p.name in sim.out else ''}" for p in sim.pods
                           if p.ready_at <= obs.end - self.tick_s) or "-"
        why = scaled.reason if scaled is not None else ""
        settling = " " if self.plan[tick][1] else "*"
        print(f"{tick:>4} | {self.plan[tick][0]:>5.1f} | {obs.request_rate:>5.1f} | "
              f"{len(sim.pods):>2}/{sim.ready(obs.end):<2} | {backlog:<22} | {obs.queued:>7.0f} | "
              f"{obs.ttft_p99_s:>7.2f} | {'yes' if met else 'no':>3}{settling} | "
              f"{k.max_num_seqs:>3},{k.prefill_chunk_size:<4} | {tuner.tuned.reason:<14} | {why}")


def out_on_waiting(state: ScaleState, fleet: Fleet, policy: ScalePolicy, now: float) -> ScaleDecision:
    """The product's decision with one rule more, tried and not adopted (docs/benchmarks-autoscaling.md, "F = 2
    behind round-robin"): where it would hold or scale in, a fleet that meets its SLO while requests wait
    for a batch slot (half a request per pod or more on average: what the headroom test counts as not
    next to nothing) and the tuner holds its knobs gets one pod more, and the per-pod rate is learned as
    what a pod carries (so that scale-in does not hand the pod straight back)."""
    d = decide_scale(state, fleet, policy, now)
    t = Tick(state, fleet, policy, now)
    obs, r = fleet.obs, fleet.reading
    if (obs is None or r is None or not r.met or r.trouble is not None or fleet.tuner_action != HOLD
            or obs.queued < 0.5 * max(obs.num_pods, 1) or fleet.replicas >= policy.max_replicas
            or next(rule for rule in SCALE_RULES if rule(t) is not None).__name__ not in ("scale_in", "hold")):
        return d
    return t.scale(SCALE_OUT, fleet.replicas + 1, f"SLO met, but {obs.queued:.1f} requests wait for a batch slot "
                   f"and the tuner holds its knobs", capacity=t.per_pod_rate or None)


class LatencyHeadroom(Tick):
    """The product's tick with headroom judged on latency alone, tried and not adopted
    (docs/benchmarks-autoscaling.md, "Headroom judged on TTFT alone"): the SLO met with TTFT, the queue's
    drain included (the reading's), under the headroom line and the queue not growing, however many
    requests wait. Two pods at 80% of their capacity keep a request or two waiting at a TTFT far under its
    SLO, so their headroom holds through the peak; the scale-in then fits the peak's windows too
    (`Tick.load`), and the pod goes a scale-down window after them."""

    @cached_property
    def headroom(self) -> bool:
        f = self.fleet
        if f.obs is None or f.obs.preemption_rate > 0:
            return False
        if f.reading is None:
            return f.obs.queued < 0.5 * max(f.replicas, 1)
        r = f.reading
        return r.met and r.ttft <= self.policy.headroom_line and r.trouble is None and self.growth is None


def headroom_on_latency(state: ScaleState, fleet: Fleet, policy: ScalePolicy, now: float) -> ScaleDecision:
    """`decide_scale` on a `LatencyHeadroom` tick."""
    t = LatencyHeadroom(state, fleet, policy, now)
    return next(d for rule in SCALE_RULES if (d := rule(t)) is not None)


def tuner_holds_while_scaling(state: ScaleState, replicas: int, ready: int, policy: ScalePolicy,
                              now: float, queued: float = 0.0) -> str | None:
    """A rule tried for the tuner and not adopted (docs/benchmarks-autoscaling.md): while the replicas change
    under it, its window holds the fleet before the change, so it holds every move until a window holds
    only the new fleet (the scaler's own `settling`), after a scale-in too. `queued`: requests waiting in
    the tuner's window. The reason, or None."""
    if (why := told(scale_out_in_flight(state, replicas, ready, policy, now), queued)) is not None:
        return str(why)
    last = state.last_scale_time
    if state.last_direction != SCALE_IN or last is None or now - last >= policy.settle_s:
        return None
    return f"the fleet is settling after the last scale-in ({policy.settle_s - (now - last):.0f} s left)"


def cases(fleet: int, routing: str, start_s: float, scenario: Scenario = TUNING_TESTS) -> dict[str, dict]:
    """Each case's keyword arguments to `simulate` (`asks`: an `Asks` probe)."""
    hi, peak = 2 * fleet, peak_tick(scenario)
    lead = -(-start_s // scenario.tick_s)  # ticks a pod takes to be ready, rounded up
    return {
        "as is": {},
        "foresight": {"asks": Asks(peak, hi)},
        "pre-provisioned": {"asks": Asks(peak - int(lead), hi)},
        "pods ready in half the time": {"start_s": start_s / 2},
        "maxReplicas 2F+1": {"max_replicas": hi + 1},
        "maxReplicas 3F": {"max_replicas": 3 * fleet},
        "maxReplicas 4F": {"max_replicas": 4 * fleet},
        "minReplicas 2": {"min_replicas": 2},
        "pod more on waiting queue": {"scaler": out_on_waiting},
        "tuner holds while scaling": {"tuner_hold": tuner_holds_while_scaling},
        "headroom on latency alone": {"scaler": headroom_on_latency},
        "no rotation": {"rotation": False},
        "least-load": {"routing": "least-load"},
    } if routing != "least-load" else {"as is": {}, "foresight": {"asks": Asks(peak, hi)},
                                       "pod more on waiting queue": {"scaler": out_on_waiting},
                                       "tuner holds while scaling": {"tuner_hold": tuner_holds_while_scaling},
                                       "headroom on latency alone": {"scaler": headroom_on_latency}}


def run_case(fleet: int, seed: int, routing: str, start_s: float, kw: dict, trace: Trace | None = None,
             scenario: Scenario = TUNING_TESTS) -> Run:
    kw = dict(kw)
    asks = kw.pop("asks", None)
    if trace is not None:
        trace.inner = asks
    probe = trace if trace is not None else asks
    return simulate(fleet, seed, "replicas", 0.0, kw.pop("start_s", start_s), kw.pop("routing", routing),
                    probe=probe, scenario=scenario, **kw)


def missed(run: Run) -> int:
    return sum(1 for w, s in zip(run.within, run.settled, strict=True) if s and not w)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleet", type=int, default=2)
    ap.add_argument("--routing", choices=ROUTINGS, default="round-robin")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="tuning-tests",
                    help="benchmarks/fleet_scenario.py's: the tuning tests' model, or it fitted to the live pods")
    ap.add_argument("--start-s", type=float, default=None, help="seconds a new pod takes to be ready "
                    "(default: the scenario's)")
    ap.add_argument("--no-rotation", action="store_true",
                    help="every case behind round-robin as a plain Service alone (no operator's rotation)")
    ap.add_argument("--trace", type=int, metavar="SEED", help="print one seed's run tick by tick")
    ap.add_argument("--case", default="as is", help="the case to trace")
    ap.add_argument("--ticks", default=None, help="the ticks to trace, LO-HI (default: from 2 before the peak, 22)")
    args = ap.parse_args(argv)
    scenario = SCENARIOS[args.scenario]()
    start_s = scenario.start_s if args.start_s is None else args.start_s
    table = cases(args.fleet, args.routing, start_s, scenario)
    if args.no_rotation:
        table = {name: kw | {"rotation": False} for name, kw in table.items()}
    if args.trace is not None:
        if args.case not in table:
            ap.error(f"--case: one of {', '.join(table)}")
        peak = peak_tick(scenario)
        lo, hi = (int(x) for x in (args.ticks or f"{peak - 2}-{peak + 20}").split("-"))
        print(f"{'tick':>4} | {'load':>5} | {'done':>5} | {'n/rdy':<5} | {'backlog per ready pod':<22} | "
              f"{'waiting':>7} | {'TTFT99':>7} | SLO  | {'knobs':<8} | {'tuner':<14} | autoscaler")
        run_case(args.fleet, args.trace, args.routing, start_s, table[args.case],
                 Trace(lo, hi, load(args.fleet, scenario), tick_s=scenario.tick_s), scenario)
        return 0
    rotation = "" if args.routing != "round-robin" else ", no rotation" if args.no_rotation else ", rotation"
    print(f"F = {args.fleet}, {args.routing}{rotation}, {args.seeds} seeds, scenario {scenario.name}")
    print(f"{'case':<28} | {'after convergence':>17} | {'missed per seed':<18} | {'replica-s':>9}")
    for name, kw in table.items():
        runs_ = [run_case(args.fleet, seed, args.routing, start_s, kw, scenario=scenario) for seed in range(args.seeds)]
        share = statistics.median(r.summary()["within_slo_settled"] for r in runs_)
        cost = statistics.median(r.replica_s for r in runs_)
        print(f"{name:<28} | {share:>17.1%} | {','.join(str(missed(r)) for r in runs_):<18} | {cost:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
