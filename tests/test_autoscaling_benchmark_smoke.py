"""benchmarks/autoscaling.py: its HPA model behaves as the HPA it stands for, and the whole comparison runs
and writes its JSON, behind both routings, the HPA behind round-robin with the operator's rotation and
without (one small fleet, one seed: the figures are checked only for their shape and for what holds in
any run: knobs alone cannot carry a peak sized for several pods)."""

from __future__ import annotations

import json

import pytest

from benchmarks.autoscaling import Hpa, best_hpa, main
from benchmarks.fleet_sim import ROUTINGS
from iterserve.operator.tuning.observation import Observation


def queue(waiting: float, pods: int) -> Observation:
    return Observation(start=0, end=30, num_pods=pods, num_samples=100, ttft_p99_s=0.1, itl_p99_s=0.01,
                       request_rate=10, prompt_token_rate=1000, generation_token_rate=500, waiting=waiting,
                       running=8, queue_time_mean_s=None, kv_usage=0.2, preemption_rate=0, error_rate=0)


def test_hpa_model_tolerance_step_limit_and_slow_scale_down():
    hpa = Hpa(threshold=2.0, lo=1, hi=20)
    assert hpa.desired(4, queue(8.5, 4), now=0) == 4  # 2.1 per pod: inside the 10% tolerance
    assert hpa.desired(4, queue(80, 4), now=30) == 8  # 10x wanted: at most double (or +4) a period
    assert hpa.desired(8, queue(0, 8), now=60) == 8  # the window still remembers 8 recommended
    assert hpa.desired(8, queue(0, 8), now=400) == 7  # past it: one pod down...
    assert hpa.desired(7, queue(0, 7), now=430) == 7  # ...and not another within the minute
    assert hpa.desired(7, queue(0, 7), now=460) == 6


def test_the_comparison_runs_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "autoscaling.json"
    assert main(["--fleets", "4", "--seeds", "1", "--thresholds", "1,4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [row["routing"] for row in rows] == list(ROUTINGS)  # both routings unless told otherwise
    for row in rows:
        assert set(row["hpa"]) == {"1.0", "4.0"} and row["best_hpa_threshold"] in (1.0, 4.0)
        assert row["knobs"]["peak_replicas"] == 1 and row["knobs"]["within_slo_settled"] < 0.5
        assert row["replicas"]["peak_replicas"] > 1
    robin, least = rows
    # behind round-robin the operator rotates, and the HPA's grid has it on and off; the router never rotates
    assert robin["rotation"] and set(robin["hpa_no_rotation"]) == {"1.0", "4.0"}
    assert not least["rotation"] and "hpa_no_rotation" not in least and least["best_hpa_rotation"] is False
    out_text = capsys.readouterr().out
    assert "knobs + replicas" in out_text and "rot " in out_text  # the round-robin HPA's row says which
    with pytest.raises(SystemExit):
        main(["--routings", "random"])


def test_without_rotation_round_robin_is_a_plain_service_for_every_controller(tmp_path):
    out = tmp_path / "autoscaling.json"
    assert main(["--fleets", "2", "--seeds", "1", "--thresholds", "0.5", "--routings", "round-robin",
                 "--no-rotation", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert not row["rotation"] and "hpa_no_rotation" not in row and row["best_hpa_rotation"] is False


def test_the_best_hpa_is_the_cheapest_that_meets_the_target_else_the_closest():
    def s(settled: float, cost: float) -> dict:
        return {"within_slo_settled": settled, "replica_s": cost}

    grid = {(1.0, True): s(1.0, 900), (1.0, False): s(0.99, 800), (4.0, False): s(0.9, 500)}
    assert best_hpa(grid)[0] == (1.0, False)
    assert best_hpa({(1.0, True): s(0.95, 900), (4.0, False): s(0.9, 500)})[0] == (1.0, True)


def test_max_replicas_bounds_the_autoscaler_and_the_hpa_alike(tmp_path):
    out = tmp_path / "autoscaling.json"
    assert main(["--fleets", "2", "--seeds", "1", "--thresholds", "0.5", "--routings", "round-robin",
                 "--max-replicas", "1", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["replicas"]["peak_replicas"] == 2 and row["hpa"]["0.5"]["peak_replicas"] == 2  # 1 x F, reached


def test_min_replicas_bounds_the_autoscaler_and_the_hpa_alike_from_the_start(tmp_path):
    out = tmp_path / "autoscaling.json"
    assert main(["--fleets", "2", "--seeds", "1", "--thresholds", "16", "--routings", "round-robin",
                 "--min-replicas", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"][0]
    # 130 ticks of 30 s at 2 pods at least: the fleet starts at minReplicas (spec.replicas is clamped into it)
    assert row["knobs"]["replica_s"] == 2 * 130 * 30
    assert row["replicas"]["replica_s"] >= 2 * 130 * 30 and row["hpa"]["16.0"]["replica_s"] >= 2 * 130 * 30


def test_the_whatif_waiting_rule_adds_one_pod_only_where_the_product_would_hold():
    from benchmarks.autoscaling_whatif import out_on_waiting
    from iterserve.operator.tuning.actions import HOLD, RAISE_SEQS
    from iterserve.operator.tuning.decision import Condition
    from iterserve.operator.tuning.policy import TuningPolicy
    from iterserve.operator.tuning.reading import read
    from iterserve.operator.tuning.scale import SCALE_OUT, STAY, Fleet, ScalePolicy, ScaleState

    tuning, policy = TuningPolicy(ttft_p99_ms=1000, itl_p99_ms=100, min_samples=20), ScalePolicy(1, 4)
    met = Condition("True", "SLOMet", "met")

    def view(waiting: float, pods: int = 1, action: str = HOLD) -> Fleet:
        obs = queue(waiting, pods)
        return Fleet(replicas=pods, ready=pods, obs=obs, reading=read(obs, tuning), verdict=met, tuner_action=action,
                     batch_cap=12)

    d = out_on_waiting(ScaleState(), view(3.0), policy, 30.0)
    assert (d.action, d.replicas, d.state.capacity) == (SCALE_OUT, 2, 10.0)  # the per-pod rate, learned
    assert out_on_waiting(ScaleState(), view(0.4), policy, 30.0).action == STAY  # under half a request per pod
    assert out_on_waiting(ScaleState(), view(3.0, action=RAISE_SEQS), policy, 30.0).action == STAY  # knobs first
    assert out_on_waiting(ScaleState(), view(12.0, pods=4), policy, 30.0).action == STAY  # at maxReplicas
