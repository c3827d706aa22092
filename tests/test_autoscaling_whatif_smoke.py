"""benchmarks/autoscaling_whatif.py: its counterfactuals change what they say they change, and the bounds
docs/benchmarks-autoscaling.md states hold in the model: at F = 2 behind a plain Service without the
operator's rotation, even maxReplicas asked for at the peak's first instant leaves windows over the SLO
after convergence (the backlog one pod takes before its peers are ready stays on it), where pods ready
before the peak, least-load routing, or the rotation (the run as is) leave none; the tuner held while the
fleet changes (tried, not adopted) moves no knob while pods start. One seed; the simulation is
deterministic per seed."""

from __future__ import annotations

import pytest

from benchmarks.autoscaling_whatif import (
    LatencyHeadroom,
    cases,
    main,
    missed,
    peak_tick,
    run_case,
    tuner_holds_while_scaling,
)
from benchmarks.fleet_scenario import TUNING_TESTS
from iterserve.operator.tuning.actions import HOLD
from iterserve.operator.tuning.decision import Condition
from iterserve.operator.tuning.observation import Observation
from iterserve.operator.tuning.policy import TuningPolicy
from iterserve.operator.tuning.reading import read
from iterserve.operator.tuning.scale import SCALE_IN, SCALE_OUT, Fleet, ScalePolicy, ScaleState
from iterserve.operator.tuning.scale_tick import Tick

PEAK_TICK = peak_tick(TUNING_TESTS)


def test_the_asks_resize_before_any_window_shows_the_peak():
    table = cases(2, "round-robin", 60.0)
    plain = {name: kw | {"rotation": False} for name, kw in table.items()}  # a plain Service alone
    asis = run_case(2, 0, "round-robin", 60.0, plain["as is"])
    foresight = run_case(2, 0, "round-robin", 60.0, plain["foresight"])
    early = run_case(2, 0, "round-robin", 60.0, plain["pre-provisioned"])
    assert asis.replicas[PEAK_TICK] == 1 and asis.replicas[PEAK_TICK + 1] == 4  # asked on the peak's first window
    assert foresight.replicas[PEAK_TICK] == 4 and early.replicas[PEAK_TICK - 2] == 4
    assert missed(foresight) >= 1 and missed(asis) >= missed(foresight)
    assert missed(early) == 0
    assert missed(run_case(2, 0, "round-robin", 60.0, table["least-load"])) == 0
    wider = run_case(2, 0, "round-robin", 60.0, plain["maxReplicas 3F"])
    assert max(wider.replicas) == 6 and missed(wider) < missed(asis)
    # the case "no rotation" is that plain Service; as is, the operator's rotation drains the backlog
    assert missed(run_case(2, 0, "round-robin", 60.0, table["no rotation"])) == missed(asis)
    rotated = run_case(2, 0, "round-robin", 60.0, table["as is"])
    assert missed(rotated) == 0 and rotated.replicas == asis.replicas
    assert "no rotation" not in cases(2, "least-load", 60.0)


def test_the_trace_prints_each_tick_asked_for(capsys):
    assert main(["--trace", "0", "--ticks", "19-23"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[0].startswith("tick")
    assert "1 -> 4 replicas" in lines[2] and " 1/1 " in lines[2] and "no*" in lines[2]
    assert "4/1" in lines[3]  # asked for, not yet ready
    assert main(["--trace", "0", "--ticks", "23-23"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "o,0,0,0 " in line  # the pod that took the step is out of rotation, the three new ones in


class Decisions:
    """Records each tick's tuner decision and the replicas asked for and ready before it."""

    def __init__(self):
        self.ticks = []

    def before(self, tick, sim, t):
        pass

    def after(self, tick, sim, obs, met, tuner, scaled):
        self.ticks.append((len(sim.pods), sim.ready(obs.end), tuner))


def test_the_tuner_held_while_scaling_moves_no_knob_while_pods_start():
    held, free = Decisions(), Decisions()
    table = cases(8, "round-robin", 60.0)
    run_case(8, 0, "round-robin", 60.0, table["tuner holds while scaling"], held)
    run_case(8, 0, "round-robin", 60.0, table["as is"], free)
    starting = [d for n, ready, d in held.ticks if ready < n]
    assert starting and all(d.action == HOLD and "starting" in d.reason for d in starting)
    assert any(d.action != HOLD for n, ready, d in free.ticks if ready < n)  # as is, the tuner moves then


# title, scaler state, (replicas, ready), words in the reason (None: no hold); a scale-out in flight is
# fleet_change.scale_out_in_flight's (tests/test_tuning_fleet_change.py), the scale-in the what-if's own
HOLD_ROWS = [
    ("the autoscaler never moved", ScaleState(), (2, 1), None),
    ("pods a scale-out added are starting", ScaleState(last_scale_time=80.0, last_direction=SCALE_OUT, starting=True),
     (2, 1), "starting (1/2 ready)"),
    ("a scale-in: a window after it", ScaleState(last_scale_time=90.0, last_direction=SCALE_IN, whole_since=0.0),
     (1, 1), "scale-in (50 s left)"),
    ("a scale-in a window ago", ScaleState(last_scale_time=40.0, last_direction=SCALE_IN), (1, 1), None),
]


@pytest.mark.parametrize("title, state, seen, words", HOLD_ROWS, ids=[r[0] for r in HOLD_ROWS])
def test_when_the_tried_hold_holds(title, state, seen, words):
    why = tuner_holds_while_scaling(state, *seen, ScalePolicy(min_replicas=1, max_replicas=8, settle_s=60), 100.0)
    assert why is None if words is None else (why is not None and words in why), why


def test_without_rotation_every_case_runs_behind_a_plain_service(capsys):
    assert main(["--seeds", "1", "--no-rotation"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "round-robin, no rotation" in lines[0]
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in lines[2:]}
    assert rows["as is"] == rows["no rotation"]  # the case `no rotation` is then the run as is


@pytest.mark.parametrize("waiting, product, tried", [(0.0, True, True), (1.5, False, True), (3.5, False, False)])
def test_headroom_on_latency_alone_weighs_the_queue_only_through_ttft(waiting, product, tried):
    """Two pods, TTFT p99 at half its SLO: the product's headroom wants under half a request waiting per pod;
    the tried variant takes any queue whose drain (Little's law: 1.5 waiting at 4 requests/s finishing is
    0.375 s, 3.5 is 0.875 s of a 1-s SLO) keeps the reading's TTFT under the headroom line (0.8)."""
    obs = Observation(start=940.0, end=1000.0, num_pods=2, num_samples=100, ttft_p99_s=0.5, itl_p99_s=0.05,
                      request_rate=4.0, prompt_token_rate=400.0, generation_token_rate=200.0, waiting=waiting,
                      running=8.0, queue_time_mean_s=None, kv_usage=0.3, preemption_rate=0.0, error_rate=0.0)
    tuning = TuningPolicy(ttft_p99_ms=1000, itl_p99_ms=100, min_samples=20)
    fleet = Fleet(replicas=2, ready=2, obs=obs, reading=read(obs, tuning), verdict=Condition("True", "SLOMet", ""),
                  tuner_action=HOLD, batch_cap=16)
    policy = ScalePolicy(min_replicas=1, max_replicas=4)
    assert Tick(ScaleState(), fleet, policy, 1000.0).headroom is product
    assert LatencyHeadroom(ScaleState(), fleet, policy, 1000.0).headroom is tried
