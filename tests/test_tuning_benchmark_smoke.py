"""benchmarks/tuning.py: its pure figures (step load, windows, p99 with requests that never started,
convergence), and the whole script end to end in seconds on a tiny model (the figures mean nothing
there; that it runs, drives the tuner live and writes its JSON is what is checked)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks.tuning import main, make_load, parse_args, round_ms
from benchmarks.tuning_load import Phase, StepLoad, p99, window_figures
from benchmarks.tuning_report import (
    attainable,
    best_static,
    fold_repeats,
    machine_speed,
    median_or_none,
    noise_check,
    phase_spans,
    verdict,
)
from benchmarks.tuning_runs import convergence_s, within_one_step
from iterserve.bench.client import RequestRecord
from iterserve.operator.tuning.policy import TuningPolicy

POLICY = TuningPolicy(ttft_p99_ms=1000, itl_p99_ms=100)  # seqs_step 2, back-off x0.5, chunk factor 2


def test_step_load_is_seeded_and_steps_its_rate():
    load = StepLoad((Phase(5.0, 100), Phase(20.0, 100), Phase(5.0, 100)), seed=3)
    schedule = load.schedule()
    assert [(t, s.prompt_ids, s.max_tokens) for t, s in schedule] == \
        [(t, s.prompt_ids, s.max_tokens) for t, s in load.schedule()]
    per_phase = [sum(lo <= t < lo + 100 for t, _ in schedule) for lo in (0, 100, 200)]
    assert 400 < per_phase[0] < 600 and 1700 < per_phase[1] < 2300 and 400 < per_phase[2] < 600
    assert all(0 <= t < 300 for t, _ in schedule) and [s.index for _, s in schedule] == list(range(len(schedule)))
    longs = [s for _, s in schedule if s.kind == "long"]
    assert 0.4 < len(longs) / len(schedule) < 0.6
    assert all(280 <= s.input_len <= 320 for s in longs) and all(32 <= s.max_tokens <= 96 for _, s in schedule)
    assert StepLoad(load.phases, seed=4).arrivals() != load.arrivals()


def test_each_phase_may_set_its_own_mix_of_long_prompts():
    load = StepLoad((Phase(10.0, 100, long_share=0.1), Phase(10.0, 100, long_share=0.9), Phase(10.0, 100)),
                    long_share=0.5, seed=1)
    shares = [[s.kind == "long" for t, s in load.schedule() if lo <= t < lo + 100] for lo in (0, 100, 200)]
    assert [round(sum(k) / len(k), 1) for k in shares] == [0.1, 0.9, 0.5]
    assert [p["long_share"] for p in load.describe()["phases"]] == [0.1, 0.9, 0.5]


@pytest.mark.parametrize("phase_s, want", [("30", [30.0] * 3), ("30,10,30", [30.0, 10.0, 30.0])])
def test_each_phase_may_last_its_own_time(phase_s, want):
    load = make_load(parse_args(["--rates", "0.2,0.8,0.2", "--phase-s", phase_s]))
    assert [p.duration_s for p in load.phases] == want and load.duration_s == sum(want)


def test_phase_durations_must_match_the_phases(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rates", "0.2,0.8,0.2", "--phase-s", "30,10"])
    assert "--phase-s: give one duration, or one per phase (3 rates), got 2" in capsys.readouterr().err


def test_long_prompts_may_have_outputs_of_their_own():
    # documents with a one-token answer beside chats with long ones; the chats' requests stay as they were
    load = StepLoad((Phase(10.0, 100),), long_share=0.5, output=(64, 128), seed=1)
    docs = replace(load, long_output=(1, 1))
    for kind, want in (("long", {1}), ("short", {s.max_tokens for _, s in load.schedule() if s.kind == "short"})):
        assert {s.max_tokens for _, s in docs.schedule() if s.kind == kind} == want
    plain = {s.max_tokens for _, s in load.schedule() if s.kind == "long"}  # without: the load's outputs
    assert len(plain) > 1 and all(64 <= n <= 128 for n in plain)
    assert docs.describe()["long_output"] == [1, 1] and load.describe()["long_output"] == [64, 128]


@pytest.mark.parametrize("ms, rounded", [(1234.0, 1230.0), (104.0, 100.0), (4.44, 4.4), (0.02, 0.1)])
def test_calibrated_slos_never_round_to_zero(ms, rounded):
    # a tiny model's 0.8 ms gap x 5 once rounded to tens gave a 0 ms SLO, which the policy refuses
    assert round_ms(ms) == rounded


@pytest.mark.parametrize("values, expected", [
    ([], None),
    ([1.0, 2.0, 3.0], 2.98),
    ([1.0, 2.0, math.inf], math.inf),  # interpolating toward a request that never started
    ([1.0] * 200 + [math.inf], 1.0),  # one in 201 is beyond the p99's ranks
])
def test_p99(values, expected):
    assert p99(values) == pytest.approx(expected) if expected is not None else p99(values) is None


def record(start, first=None, chunks=(), ok=True) -> RequestRecord:
    r = RequestRecord(index=0, kind="long", max_tokens=len(chunks), start=start, first_token=first,
                      chunk_times=list(chunks), end=chunks[-1] if chunks and ok else None)
    if not ok:
        r.fail("cancelled", "stopped", start + 100)
    return r


def test_windows_charge_ttft_to_arrival_and_gaps_to_their_end():
    records = [record(1.0, 1.5, [1.5, 1.55, 1.6]),  # window 0: TTFT 500 ms, gaps 50 ms
               record(12.0, 14.0, [14.0, 14.05, 21.0]),  # arrives in window 1 (TTFT 2 s); a 7 s gap ends in 2
               record(25.0, ok=False)]  # window 2: never got a first token
    w = window_figures(records, 40.0, 10.0, {"ttft": 1000, "itl": 100})
    assert [x["within_slo"] for x in w] == [True, False, False, None]
    assert w[0]["ttft_p99_ms"] == 500.0 and w[1]["ttft_p99_ms"] == 2000.0 and w[2]["ttft_p99_ms"] == math.inf
    assert w[1]["itl_p99_ms"] == 50.0 and w[2]["itl_p99_ms"] == 6950.0 and w[3]["num_arrivals"] == 0


def knobs(seqs, chunk, t=0.0):
    return {"t_s": t, "max_num_seqs": seqs, "prefill_chunk_size": chunk}


@pytest.mark.parametrize("a, b, near", [
    (knobs(8, 64), knobs(10, 64), True),  # one additive step
    (knobs(32, 64), knobs(16, 64), True),  # one back-off
    (knobs(64, 64), knobs(16, 64), False),
    (knobs(8, 128), knobs(8, 64), True),  # one chunk factor
    (knobs(8, 256), knobs(8, 64), False),
])
def test_within_one_step(a, b, near):
    assert within_one_step(a, b, POLICY) is near


@pytest.mark.parametrize("trajectory, expected", [
    ([knobs(64, 256)], 0.0),  # never moved
    ([knobs(64, 256), knobs(32, 256, 18), knobs(16, 256, 33)], 20.0),  # 32 is one back-off from 16
    ([knobs(64, 256), knobs(8, 64, 5), knobs(64, 256, 95)], None),  # left a step away after the last window
    ([knobs(64, 256), knobs(8, 64, 5), knobs(8, 256, 40), knobs(8, 64, 61)], 70.0),
])
def test_convergence(trajectory, expected):
    assert convergence_s(trajectory, 10.0, 100.0, POLICY) == expected


def test_best_static_and_verdict():
    grid = [{"max_num_seqs": 4, "prefill_chunk_size": 64, "goodput_rps": 0.5, "windows_within_slo": 0.5},
            {"max_num_seqs": 8, "prefill_chunk_size": 64, "goodput_rps": 0.5, "windows_within_slo": 0.8},
            {"max_num_seqs": 64, "prefill_chunk_size": 256, "goodput_rps": 0.2, "windows_within_slo": 1.0}]
    assert best_static(grid) is grid[1]
    v = verdict({"goodput_rps": 0.56, "windows_within_slo_after_convergence": 0.99}, grid)
    assert v["best_static"] == {"max_num_seqs": 8, "prefill_chunk_size": 64}
    assert v["goodput_ratio"] == pytest.approx(1.12) and v["goodput_pass"] and v["windows_pass"]
    v = verdict({"goodput_rps": 0.5, "windows_within_slo_after_convergence": None}, grid)
    assert not v["goodput_pass"] and not v["windows_pass"]


@pytest.mark.parametrize("values, expected", [
    ([3, 1, 2], 2), ([1, 2, 3, 10], 2.5), ([None, 4, 6], 5), ([None, None, 6], None), ([None, 4], 4), ([], None),
])
def test_median_or_none_needs_half_the_values_known(values, expected):
    assert median_or_none(values) == expected


def test_repeats_fold_into_medians_and_the_verdict_pairs_rounds():
    def run(seqs, good, windows, load=(1.0, 1.0), **extra):
        return {"max_num_seqs": seqs, "prefill_chunk_size": 64, "num_requests": 40, "num_good": good,
                "goodput_rps": good / 100, "windows_within_slo": windows, "ttft_p99_ms": 900.0,
                "itl_p99_ms": 300.0, "load_average": list(load), "requests": [], "windows": [], **extra}

    single = run(8, 30, 0.9)
    assert fold_repeats([single]) is single
    runs = [run(8, 30, 0.9, (0.5, 1.5)), run(8, 20, 0.7), run(8, 24, None, (1.0, 2.5))]
    folded = fold_repeats(runs)
    assert folded["num_good"] == 24 and folded["goodput_rps"] == 0.24 and folded["windows_within_slo"] == 0.8
    assert folded["load_average"] == [0.5, 2.5] and folded["repeats"] == runs and "requests" not in folded
    tuned_runs = [run(16, g, 0.9, windows_within_slo_after_convergence=a, convergence_s=c)
                  for g, a, c in ((33, 1.0, 40.0), (22, 0.9, None), (27, 0.95, 20.0))]
    rounds = [{"grid": [s, o], "tuned": t} for s, o, t in zip(runs, [run(64, 10, 0.5)] * 3, tuned_runs, strict=True)]
    tuned = fold_repeats(tuned_runs)
    assert tuned["windows_within_slo_after_convergence"] == 0.95 and tuned["convergence_s"] == 30.0
    v = verdict(tuned, [folded, fold_repeats([r["grid"][1] for r in rounds])], rounds)
    assert v["best_static"] == {"max_num_seqs": 8, "prefill_chunk_size": 64}
    assert v["goodput_ratio"] == pytest.approx(27 / 24) and v["goodput_pass"] and not v["windows_pass"]
    assert v["goodput_ratio_per_round"] == pytest.approx([1.1, 1.1, 27 / 24])


def test_attainable_reads_each_phases_best_static_run_and_the_windows_some_setting_met():
    def run(chunk, goods, windows, **extra):
        # requests at 0..5 s: phase A is [0, 3), phase B [3, 6); windows of 2 s
        return {"max_num_seqs": 64, "prefill_chunk_size": chunk, "num_good": sum(goods),
                "requests": [{"start_s": float(t), "good": g} for t, g in enumerate(goods)],
                "windows": [{"start_s": 2.0 * i, "within_slo": w} for i, w in enumerate(windows)], **extra}

    small = run(64, [True, True, True, False, False, True], [True, True, False])  # wins A, loses B
    large = run(256, [False, True, False, True, True, True], [False, None, True])  # loses A, wins B
    spans = phase_spans([{"duration_s": 3.0}, {"duration_s": 3.0}])
    assert spans == [(0.0, 3.0), (3.0, 6.0)]
    rnd = {"grid": [small, large], "tuned": {"convergence_s": 2.0}}
    a = attainable(rnd, (64, 64), spans)
    # per phase the best: A 3 (small), B 3 (large); over small's 4 good
    assert a["num_good"] == 6 and a["goodput_ratio"] == pytest.approx(1.5)
    # some setting met the SLO in every window; a window neither decided would not count
    assert a["windows"] == 1.0 and a["windows_after_convergence"] == 1.0
    both_miss = run(256, [False, True, False, True, True, True], [False, False, False])
    a = attainable({**rnd, "grid": [small, both_miss]}, (64, 64), spans)
    assert a["windows"] == pytest.approx(2 / 3) and a["windows_after_convergence"] == 0.5
    assert attainable({**rnd, "tuned": {"convergence_s": None}}, (64, 64), spans)["windows_after_convergence"] is None
    v = verdict({"goodput_rps": 0.5, "windows_within_slo_after_convergence": 0.5},
                [{**small, "goodput_rps": 0.4, "windows_within_slo": 0.67},
                 {**large, "goodput_rps": 0.3, "windows_within_slo": 0.5}], [rnd], [{"duration_s": 3.0}] * 2)
    assert v["attainable"]["goodput_ratio"] == pytest.approx(1.5) and len(v["attainable"]["per_round"]) == 1


def test_noise_check_compares_the_requests_sent_before_the_first_change():
    def run(goods):
        return {"requests": [{"start_s": float(t), "good": g} for t, g in enumerate(goods)]}

    tuned = {**run([True, True, True, False, True]),
             "trajectory": [knobs(64, 256), {**knobs(64, 128, 3.0), "action": "lower_prefill_chunk_size"}]}
    grid = [{"max_num_seqs": 64, "prefill_chunk_size": 256, **run([True, False, True, True, True])},
            {"max_num_seqs": 8, "prefill_chunk_size": 64, **run([True] * 5)}]
    assert noise_check(tuned, grid) == {"until_s": 3.0, "num_requests": 3, "tuned_good": 3, "static_default_good": 2}
    assert noise_check(tuned, grid[1:]) is None  # no static run of the default knobs
    assert noise_check({**tuned, "trajectory": tuned["trajectory"][:1]}, grid) is None  # the tuner never moved


def test_machine_speed_flags_the_runs_whose_unloaded_gap_drifted_from_the_calibration():
    def row(chunk, *gaps):
        runs = [{"unloaded_itl_ms": g} for g in gaps]
        return {"max_num_seqs": 64, "prefill_chunk_size": chunk, **({"repeats": runs} if len(runs) > 1 else runs[0])}

    # seen on a shared machine: calibrated at 48 ms, the second round's runs 15-20% slower
    result = {"calibration": {"itl_median_ms": 48.0}, "grid": [row(128, 48.4, 57.0), row(256, 43.0, 52.7)],
              "tuned": row(None, 49.0, 56.0)}
    text, drifted = machine_speed(result)
    assert text == "unloaded median gap before each run, ms (calibration 48): 64/128 48/57, 64/256 43/53, tuned 49/56"
    # 52.7 is 9.8% off: within
    assert drifted == ["64/128 (run 2, 19% slower)", "64/256 (run 1, 10% faster)", "tuned (run 2, 17% slower)"]
    single = {**result, "grid": [row(128, 48.0)], "tuned": row(None, 60.0)}
    assert machine_speed(single)[1] == ["tuned (25% slower)"]
    # runs recorded before the gap was measured have nothing to flag
    assert machine_speed({**result, "grid": [{"max_num_seqs": 64, "prefill_chunk_size": 128}],
                          "tuned": {}}) == ("unloaded median gap before each run, ms (calibration 48): ", [])


def test_whole_script_on_a_tiny_model(tiny_dir, tmp_path, capsys):
    """A real server, the real tuner and every run of the script, shrunk to a few seconds each."""
    model = tiny_dir
    out = tmp_path / "tuning.json"
    main(["--quick", "--model", model, "--threads", "1", "--max-model-len", "256", "--kv-cache-memory", "8MiB",
          "--rates", "4,8,4", "--fixed-rates", "--phase-s", "2", "--long-prompt", "40,60", "--short-prompt", "4,8",
          "--output", "4,8", "--grid-seqs", "2,4", "--grid-chunks", "16", "--window-s", "2", "--tick-s", "0.5",
          "--tuner-window-s", "1", "--drain-s", "10", "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "tuned / best static goodput" in printed and ("PASS" in printed or "MISS" in printed)
    n = result["num_requests"]
    assert 10 < n < 100 and result["slo_ms"]["ttft"] > 0 and result["calibration"]["num_requests"] == 4
    assert result["rate_scale"] == 1.0 and [p["rate"] for p in result["load"]["phases"]] == [4, 8, 4]
    assert [(g["max_num_seqs"], g["prefill_chunk_size"]) for g in result["grid"]] == [(2, 16), (4, 16)]
    # two rounds, the second in the reverse order; every row folds its two runs into medians
    assert [r["order"] for r in result["rounds"]] == [["2/16", "tuned", "4/16"], ["4/16", "tuned", "2/16"]]
    assert "tuned / best static good requests, round by round" in printed
    assert len(result["verdict"]["goodput_ratio_per_round"]) == 2
    assert "attainable by switching among the grid's settings" in printed
    assert "unloaded median gap before each run" in printed
    reach = result["verdict"]["attainable"]
    assert len(reach["per_round"]) == 2 and all(reach["num_good"] >= g["num_good"] for g in result["grid"])
    for row in [result["tuned"], *result["grid"]]:
        assert len(row["repeats"]) == 2 and row["num_requests"] == n
        goods = [r["num_good"] for r in row["repeats"]]
        assert min(goods) <= row["num_good"] <= max(goods)
        for run in row["repeats"]:
            assert run["num_completed"] == n  # the tiny model keeps up
            assert run["unloaded_itl_ms"] > 0  # the machine's speed, measured right before the run
            assert len(run["windows"]) == 3
            assert len(run["requests"]) == n and sum(q["good"] for q in run["requests"]) == run["num_good"]
    for tuned in result["tuned"]["repeats"]:
        # the tuner ran live: its first tick brought the default knobs (64/256) into the grid's bounds
        assert tuned["trajectory"][0] == {"t_s": 0.0, "max_num_seqs": 64, "prefill_chunk_size": 256,
                                          "action": "initial"}
        assert tuned["trajectory"][1]["action"] == "clamp_to_bounds"
        assert (tuned["trajectory"][1]["max_num_seqs"], tuned["trajectory"][1]["prefill_chunk_size"]) == (4, 16)
        assert len(tuned["ticks"]) >= 5 and not tuned["tuner_errors"]
    assert result["verdict"]["best_static"] in [{"max_num_seqs": 2, "prefill_chunk_size": 16},
                                                {"max_num_seqs": 4, "prefill_chunk_size": 16}]
