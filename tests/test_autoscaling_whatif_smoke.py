"""benchmarks/autoscaling_whatif.py: its counterfactuals change what they say they change, and the bound
docs/benchmarks-autoscaling.md states holds in the model: at F = 2 behind round-robin, even maxReplicas
asked for at the peak's first instant leaves windows over the SLO after convergence (the backlog one pod
takes before its peers are ready stays on it), where pods ready before the peak, or least-load routing,
leave none. One seed; the simulation is deterministic per seed."""

from __future__ import annotations

from benchmarks.autoscaling_whatif import PEAK_TICK, cases, main, missed, run_case


def test_the_asks_resize_before_any_window_shows_the_peak():
    table = cases(2, "round-robin", 60.0)
    asis = run_case(2, 0, "round-robin", 60.0, table["as is"])
    foresight = run_case(2, 0, "round-robin", 60.0, table["foresight"])
    early = run_case(2, 0, "round-robin", 60.0, table["pre-provisioned"])
    assert asis.replicas[PEAK_TICK] == 1 and asis.replicas[PEAK_TICK + 1] == 4  # asked on the peak's first window
    assert foresight.replicas[PEAK_TICK] == 4 and early.replicas[PEAK_TICK - 2] == 4
    assert missed(foresight) >= 1 and missed(asis) >= missed(foresight)
    assert missed(early) == 0
    assert missed(run_case(2, 0, "round-robin", 60.0, table["least-load"])) == 0
    wider = run_case(2, 0, "round-robin", 60.0, table["maxReplicas 3F"])
    assert max(wider.replicas) == 6 and missed(wider) < missed(asis)


def test_the_trace_prints_each_tick_asked_for(capsys):
    assert main(["--trace", "0", "--ticks", "19-23"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[0].startswith("tick")
    assert "1 -> 4 replicas" in lines[2] and " 1/1 " in lines[2] and "no*" in lines[2]
    assert "4/1" in lines[3]  # asked for, not yet ready
