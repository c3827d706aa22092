"""benchmarks/autoscaling_live.py's figures: the windows after convergence and the best HPA threshold."""

from __future__ import annotations

from benchmarks.autoscaling_live import settled, summary
from benchmarks.tuning_load import Phase, StepLoad

LOAD = StepLoad((Phase(1.0, 60.0), Phase(3.0, 100.0), Phase(1.0, 60.0)))


def window(start: float, ok: bool | None) -> dict:
    return {"start_s": start, "within_slo": ok}


def test_settled_leaves_out_the_windows_after_each_step():
    windows = [window(20.0 * i, True) for i in range(11)]  # 0..200 s
    kept = [w["start_s"] for w in settled(windows, LOAD, settle_s=40.0, window_s=20.0)]
    # the steps are at 0, 60 and 160 s: 0-40, 60-100 and 160-200 are left out
    assert kept == [40.0, 100.0, 120.0, 140.0, 200.0]


def test_a_window_that_holds_a_steps_first_seconds_is_left_out_too():
    load = StepLoad((Phase(0.4, 90.0), Phase(1.4, 180.0), Phase(0.4, 150.0)))  # the live benchmark's
    windows = [window(20.0 * i, True) for i in range(21)]  # 0..420 s
    kept = [w["start_s"] for w in settled(windows, load, settle_s=60.0, window_s=20.0)]
    # steps at 0, 90 and 270 s: 80-100 holds the peak's first 10 s, 260-280 the low phase's
    assert kept == [60.0, 160.0, 180.0, 200.0, 220.0, 240.0, 340.0, 360.0, 380.0, 400.0]


def run(controller: str, settled_share: float, replica_s: float, failed: int = 0) -> dict:
    return {"controller": controller, "windows_within_slo": settled_share, "settled_within_slo": settled_share,
            "replica_s": replica_s, "num_failed": failed, "num_requests": 100}


def test_the_best_hpa_is_the_cheapest_that_meets_the_target_else_the_closest():
    rows = {s["controller"]: s for s in summary([
        run("replicas", 1.0, 500), run("hpa-1", 1.0, 600), run("hpa-4", 0.99, 550), run("hpa-8", 0.9, 400)])}
    assert rows["hpa-4"]["best_hpa"] and not rows["hpa-1"]["best_hpa"]
    assert rows["replicas"]["replica_s_vs_best_hpa"] == round(500 / 550, 2)
    # no threshold reaches 99%: the one with the most windows within the SLO
    rows = {s["controller"]: s for s in summary([run("hpa-1", 0.95, 600), run("hpa-4", 0.9, 500)])}
    assert rows["hpa-1"]["best_hpa"]


def test_medians_over_rounds_and_failures_summed():
    rows = summary([run("replicas", 1.0, 500, failed=1), run("replicas", 0.9, 700), run("replicas", 0.95, 600)])
    assert rows[0]["rounds"] == 3 and rows[0]["settled_within_slo"] == 0.95 and rows[0]["replica_s"] == 600
    assert rows[0]["failed"] == 1 and rows[0]["requests"] == 300
    assert rows[0]["replica_s_vs_best_hpa"] is None  # no HPA run
