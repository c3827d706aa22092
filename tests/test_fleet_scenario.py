"""benchmarks/fleet_scenario.py: the latency model fitted to the live pods gives back what their calibration
measured, it poses the live benchmark's problem (one pod cannot carry the peak within the SLO, two can),
and the simulator runs it at the operator's live cadence (5-s ticks on 20-s windows, the SLO judged on
back-to-back windows, pods sharing the machine's cores); the table of record's scenario is unchanged."""

from __future__ import annotations

import pytest

from benchmarks.autoscaling import CAPACITY, simulate
from benchmarks.fleet_scenario import LIVE_CALIBRATION, SCENARIOS, TUNING_TESTS, fit_model, live_fit, live_fit_dips
from benchmarks.fleet_sim import FleetSim, merge_windows
from iterserve.operator.tuning.observation import Observation
from tests.tuning_latency_model import LatencyModel


def test_the_fitted_model_gives_the_calibration_back():
    cal = LIVE_CALIBRATION
    params = fit_model(cal)
    model = LatencyModel(**params)
    assert params["t0"] + params["per_seq"] == pytest.approx(cal.itl_s)  # one sequence decoding alone
    assert model.steady(cal.start, 0.0, saturated=True).capacity == pytest.approx(cal.one_pod_rps)
    # the long prompt alone: its 3 prefill steps' fixed cost and its tokens (the gap's per-sequence part,
    # which a prompt alone does not pay, is the difference)
    long_alone = LatencyModel(**{**params, "prompt": round(cal.long_prompt)}).steady(cal.start, 1e-6).prefill_s
    assert long_alone == pytest.approx(cal.long_ttft_s, rel=0.03)
    assert 0 < params["per_seq"] < params["t0"] and params["per_prefill_token"] > 0


def test_the_live_fit_poses_the_live_problem_and_the_record_scenario_is_the_tuning_tests():
    assert TUNING_TESTS.slo_capacity() == pytest.approx(CAPACITY, rel=0.01)
    sc = live_fit()
    peak = max(rate for rate, _ in sc.phases) * 2  # F = 2: the live run
    assert peak == pytest.approx(1.4 * LIVE_CALIBRATION.one_pod_rps)
    assert sc.slo_capacity() < peak < 2 * sc.slo_capacity()  # one pod cannot carry it at any knobs; two can
    assert sc.window_ticks == 4 and sc.ticks(sc.settle_s) == 12
    assert live_fit(shared_cores=True).shared_cores[2] == pytest.approx(6.45 / 7.30)


def test_the_dips_break_the_live_peak_with_steps_down_that_do_not_last():
    sc, live = live_fit_dips(), live_fit()
    assert (sc.model, sc.policy, sc.start, sc.start_s, sc.scale_down_s, sc.hpa_period_s) == (
        live.model, live.policy, live.start, live.start_s, live.scale_down_s, live.hpa_period_s)
    (low, _), (high, _), _ = live.phases
    assert sc.phases == ((low, 90.0), (high, 150.0), (low, 30.0), (high, 150.0), (low, 30.0), (high, 150.0),
                         (low, 150.0))
    assert SCENARIOS["live-fit-dips"]().phases == sc.phases
    run = simulate(2, seed=0, controller="replicas", max_replicas=2, scenario=sc)
    assert len(run.replicas) == sum(s for _, s in sc.phases) / sc.tick_s
    # each dip's first 60 s count as settling: the dips and the windows after them are not judged
    assert sum(run.settled) == 17


def test_pods_sharing_the_cores_finish_less_each():
    sc = live_fit(shared_cores=True)
    knobs = sc.start
    alone = FleetSim(2, seed=0, start_s=12, model=sc.model).window(knobs, 10.0, 0, 20)
    shared = FleetSim(2, seed=0, start_s=12, model=sc.model, shared_cores=sc.shared_cores).window(knobs, 10.0, 0, 20)
    assert shared.request_rate == pytest.approx(alone.request_rate * sc.shared_cores[2], rel=1e-6)


def test_windows_merge_as_the_operators_sliding_window_reads_them():
    def sub(start: float, rate: float, waiting: float, p99: float, samples: int) -> Observation:
        return Observation(start=start, end=start + 5, num_pods=2, num_samples=samples, ttft_p99_s=p99,
                           itl_p99_s=0.1, request_rate=rate, prompt_token_rate=rate * 100,
                           generation_token_rate=rate * 10, waiting=waiting, running=4.0, queue_time_mean_s=0.5,
                           kv_usage=0.1 * samples, preemption_rate=0.0, error_rate=0.0)

    one = sub(0, 2.0, 1.0, 1.0, 10)
    assert merge_windows([one]) is one
    both = merge_windows([one, sub(5, 4.0, 3.0, 2.0, 30)])
    assert (both.start, both.end, both.num_samples) == (0, 10, 40)
    assert both.request_rate == pytest.approx(3.0) and both.waiting == pytest.approx(2.0)
    assert both.kv_usage == pytest.approx(3.0)  # the highest
    assert 1.0 < both.ttft_p99_s < 2.0 and both.ttft_p99_s > 1.5  # pooled, the busier window weighing more


def test_the_live_fit_runs_at_the_live_cadence():
    sc = live_fit(shared_cores=True)
    run = simulate(2, seed=0, controller="replicas", max_replicas=2, scenario=sc)
    seconds = sum(s for _, s in sc.phases)
    assert len(run.replicas) == seconds / sc.tick_s  # a tick every 5 s
    assert len(run.within) == len(run.settled) == seconds / sc.policy.window_s  # the SLO judged every 20 s
    # "after convergence" leaves out the windows that overlap the 60 s after each step: 3 after the start,
    # 4 after each of the others (steps at 90 and 270 s, within a window)
    assert run.settled == [False] * 3 + [True] + [False] * 4 + [True] * 5 + [False] * 4 + [True] * 4
    assert run.replicas[0] == 1 and max(run.replicas) == 2 and run.replicas[-1] == 1  # out at the peak, back in
    knobs_only = simulate(2, seed=0, controller="knobs", scenario=sc)
    assert max(knobs_only.replicas) == 1
    assert sum(run.within) > sum(knobs_only.within)
